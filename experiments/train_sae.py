r"""Train one sparse autoencoder per layer on a model's activations across denoising steps (TopK or JumpReLU, in
JAX with optax), saved in SAELens's format.

  python -m experiments.train_sae --output_dir=results/sae_tiny_dlm
  python -m experiments.train_sae --checkpoint=tiny-dlm --site=hook_resid_post --layers=0,2 \
      --architecture=jumprelu --l0_coefficient=0.3 --d_sae=1024 --output_dir=/tmp/sae

Data: the model's sampler (temperature 0, steps = gen_length, one block: the decoding of
experiments.evaluate_synthetic) runs on --n_train problems of the synthetic task's *train* split, capturing
the site at every step; every (problem, step, generated position) is a row, masked and decoded positions alike
(`experiments.common.sae_runs`). The rows are saved once (activations.npz) and reused on resume. Or, with
--dataset, the rows of a trajectory dataset of the same checkpoint (experiments.export_trajectories; its
column of each layer's site, e.g. blocks.1.hook_resid_post), read batch by batch from its shards:

  python -m experiments.export_trajectories --checkpoints=tiny-dlm --output_dir=/tmp/traj
  python -m experiments.train_sae --dataset=/tmp/traj/tiny-dlm --output_dir=/tmp/sae

Training (`dlm_jax.training.sae_loop`): --train_steps optax steps of --train_batch_size rows, data-parallel over
--mesh when given; each layer's run keeps orbax checkpoints in runs/<site>/ (every --checkpoint_every steps),
so a killed run resumes where it stopped; run.json refuses a resume with other settings.

Outputs in --output_dir: saes/<site>/ (cfg.json + sae_weights.safetensors, loadable with
`sae_lens.SAE.load_from_disk` and `dlm_jax.io.saelens.load`), layers.jsonl (one line per finished layer: the
last training metrics and the logged history), train.json (all layers) and training.png (MSE, L0 and dead
features over training). Evaluate the SAEs with experiments.evaluate_sae.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
from absl import flags, logging

from dlm_jax.instrument import sites
from dlm_jax.io import saelens, trajectory_dataset
from dlm_jax.training import sae_loop
from dlm_jax.training import sae_objectives as objectives
from dlm_jax.session import decode_settings
from experiments.common import (atomic_files, checkpoints, cli, devices, flag_checks, numerics, numerics_flags,
                                output_flags, progress, prompts, run_dir, runtime_flags, sae_runs)
from experiments.reports import sae_figures

_CHECKPOINT = flags.DEFINE_string("checkpoint", "tiny-dlm", "Converted checkpoint directory, or tiny-dlm, "
                                  "tiny-uniform-dlm, ...")
_SITE = flags.DEFINE_string("site", "hook_resid_post", "Per-layer site kind (dlm_jax.instrument.sites).")
_LAYERS = flags.DEFINE_list("layers", [], "Layers (default: every layer).")
_DATASET = flags.DEFINE_string("dataset", None, "A trajectory dataset of this checkpoint "
                               "(experiments.export_trajectories) to train on: its column of each layer's site, "
                               "read batch by batch. Without it the binary decodes --n_train problems itself.")
_N_TRAIN = flags.DEFINE_integer("n_train", 128, "Problems of the synthetic train split whose activations are used.")
_DATA_SEED = flags.DEFINE_integer("data_seed", 0, "Seed of the synthetic generator.")
_GEN_LENGTH = flags.DEFINE_integer("gen_length", 32, "Generated positions.")
_STEPS = flags.DEFINE_integer("steps", None, "Diffusion steps (default: gen_length).")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 32, "Prompts per sampler call (results do not depend on it).")
_ARCHITECTURE = flags.DEFINE_enum("architecture", "topk", list(objectives.TRAIN_ARCHITECTURES), "SAE architecture.")
_D_SAE = flags.DEFINE_integer("d_sae", 512, "Features per SAE.")
_K = flags.DEFINE_integer("k", 16, "TopK: features kept per row.")
_L0_COEFFICIENT = flags.DEFINE_float("l0_coefficient", 0.1, "JumpReLU: weight of the L0 penalty (the defaults of "
                                     "the three JumpReLU flags give L0 ≈ 16 on tiny-dlm; BUILD.md).")
_BANDWIDTH = flags.DEFINE_float("bandwidth", 0.1, "JumpReLU: straight-through estimator bandwidth.")
_INIT_THRESHOLD = flags.DEFINE_float("init_threshold", 0.3, "JumpReLU: initial threshold (> 0).")
_TRAIN_STEPS = flags.DEFINE_integer("train_steps", 3000, "Optimizer steps per layer.")
_TRAIN_BATCH_SIZE = flags.DEFINE_integer("train_batch_size", 512, "Rows per optimizer step.")
_LR = flags.DEFINE_float("lr", 1e-3, "Adam learning rate (linear warm-up over 50 steps, decay over the last 20%).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the SAE initialisation and the batch order.")
_CHECKPOINT_EVERY = flags.DEFINE_integer("checkpoint_every", 500, "Orbax checkpoint interval in steps.")


@dataclasses.dataclass(frozen=True)
class Settings:
  """Everything that defines a train_sae run (recorded in run.json)."""

  checkpoint: dict
  dataset: dict | None
  site: str
  layers: tuple[int, ...]
  n_train: int
  data_seed: int
  decode: dict
  objective: dict
  train: dict


def _objective(d_in: int) -> objectives.SAEObjective:
  flag_checks.positive(d_sae=_D_SAE.value, k=_K.value, train_steps=_TRAIN_STEPS.value,
                       train_batch_size=_TRAIN_BATCH_SIZE.value)
  flag_checks.above_zero(lr=_LR.value, bandwidth=_BANDWIDTH.value, init_threshold=_INIT_THRESHOLD.value)
  if _L0_COEFFICIENT.value < 0:
    raise cli.UserError(f"--l0_coefficient={_L0_COEFFICIENT.value}: expected >= 0")
  if _ARCHITECTURE.value == "topk" and _K.value > _D_SAE.value:
    raise cli.UserError(f"--k={_K.value}: expected at most --d_sae={_D_SAE.value}")
  return objectives.SAEObjective(_ARCHITECTURE.value, d_in=d_in, d_sae=_D_SAE.value, k=_K.value,
                                 l0_coefficient=_L0_COEFFICIENT.value, bandwidth=_BANDWIDTH.value,
                                 init_threshold=_INIT_THRESHOLD.value)


def _layers(config) -> tuple[int, ...]:
  try:
    layers = tuple(int(x) for x in _LAYERS.value) or tuple(range(config.n_layers))
  except ValueError:
    raise cli.UserError(f"--layers={','.join(_LAYERS.value)}: expected layer indices") from None
  flag_checks.layers_of_model(layers, "--layers", config.n_layers)
  for layer in layers:
    kinds = [k for k in sites.LAYER_SITES if k != "attn.hook_pattern"]
    why = sites.unavailable(config, _SITE.value, layer) if _SITE.value in kinds else (
        f"--site={_SITE.value}: expected a per-layer site kind with values per position ({', '.join(kinds)})")
    if why is not None:
      raise cli.UserError(why)
  return layers


def _dataset(model, names: list[str], width: int) -> trajectory_dataset.TrajectoryDataset | None:
  """The --dataset, checked before any model work: this checkpoint's rows, a column per site of `width`."""
  if _DATASET.value is None:
    return None
  flag_checks.not_blank(dataset=_DATASET.value)
  try:
    ds = trajectory_dataset.open_trajectory_dataset(_DATASET.value, expect_model=checkpoints.identity(model.directory))
  except trajectory_dataset.TrajectoryDatasetError as e:
    raise cli.UserError(f"--dataset={_DATASET.value}: {e}") from None
  for name in names:
    if name not in ds.columns:
      raise cli.UserError(f"--dataset={_DATASET.value}: no column {name!r} (its columns: {', '.join(ds.columns)}); "
                          "export that site or choose --site / --layers among them")
    if int(np.prod(ds.manifest["columns"][name]["shape"])) != width or len(ds.manifest["columns"][name]["shape"]) != 1:
      raise cli.UserError(f"--dataset={_DATASET.value}: column {name!r} has shape "
                          f"{ds.manifest['columns'][name]['shape']}, expected [{width}] per row")
  if ds.num_rows == 0:
    raise cli.UserError(f"--dataset={_DATASET.value}: the dataset has no rows")
  return ds


def _dataset_record(dataset: trajectory_dataset.TrajectoryDataset, names: list[str]) -> dict:
  """What run.json records of the dataset: its path, rows and the SHA-256 of every file of the columns used."""
  return {"path": progress.display_path(dataset.path), "rows": dataset.num_rows,
          "sha256": {name: [shard["files"][name]["sha256"] for shard in dataset.manifest["shards"]] for name in names}}


def main(argv):
  del argv
  runtime_settings = runtime_flags.from_flags()
  output = output_flags.from_flags("train_sae")
  model = checkpoints.prepare(_CHECKPOINT.value, "auto", "training")
  layers = _layers(model.config)
  width = int(np.prod(sites.feature_shape(model.config, _SITE.value, layers[0])))
  objective = _objective(width)
  names = [sites.full_name(_SITE.value, layer) for layer in layers]
  dataset = _dataset(model, names, width)
  flag_checks.positive(n_train=_N_TRAIN.value, batch_size=_BATCH_SIZE.value, gen_length=_GEN_LENGTH.value)
  if _CHECKPOINT_EVERY.value < 0:
    raise cli.UserError(f"--checkpoint_every={_CHECKPOINT_EVERY.value}: expected >= 0")
  config = sae_loop.SAETrainConfig(steps=_TRAIN_STEPS.value, batch_size=_TRAIN_BATCH_SIZE.value, lr=_LR.value,
                                   seed=_SEED.value, checkpoint_every=_CHECKPOINT_EVERY.value)
  decode = decode_settings.DecodeSettings(gen_length=_GEN_LENGTH.value, steps=_STEPS.value,
                                          block_length=_GEN_LENGTH.value)
  values = decode_settings.model_settings(decode, model)
  settings = Settings(checkpoint=checkpoints.identity(model.directory),
                      dataset=None if dataset is None else _dataset_record(dataset, names),
                      site=_SITE.value, layers=layers,
                      n_train=_N_TRAIN.value, data_seed=_DATA_SEED.value, decode=values,
                      objective=dataclasses.asdict(objective),
                      train={k: v for k, v in dataclasses.asdict(config).items()
                             if k not in ("checkpoint_every", "log_every")})
  run = run_dir.RunDir(output.output_dir, dataclasses.asdict(settings), overwrite=output.overwrite,
                       inputs=[model.directory])
  runtime = devices.init_runtime(runtime_settings)
  if runtime.mesh is not None and config.batch_size % runtime.batch_shards:
    raise cli.UserError(f"--train_batch_size={config.batch_size}: expected a multiple of the mesh's "
                        f"{runtime.batch_shards} batch shards")
  numeric_settings = numerics_flags.from_flags(runtime_settings)
  model = checkpoints.load_weights(model, runtime, numeric_settings)
  progress.quiet_orbax()
  log = run_dir.ResultsLog(run, "layers.jsonl", ("site",))
  data_file = run.file("activations.npz")
  if dataset is not None:
    data = {name: dataset.column_view(name) for name in names}
  elif not all(log.done(site=name) for name in names):
    if os.path.exists(data_file):
      data = dict(np.load(data_file))
    else:
      problems = sae_runs.synthetic_items("train", _N_TRAIN.value, _DATA_SEED.value)
      collected = sae_runs.collect(model, values, prompts.encode(model, problems), problems, runtime, numeric_settings,
                                   _SITE.value, layers, _BATCH_SIZE.value, decode.seed, model.label)
      data = {**collected.values, "step": collected.step, "masked": collected.masked}
      run.write_npz("activations.npz", **data)
  for name in names:
    if log.done(site=name):
      continue
    result = sae_loop.train_sae(objective, config, sae_loop.ArrayBatches(data[name], config.batch_size, config.seed),
                                run_dir=run.file(os.path.join("runs", name)), mesh=runtime.mesh,
                                log=lambda line, name=name: logging.info("%s: %s", name, line))
    saelens.save(result.sae, sae_runs.sae_dir(run.path, name), hook_name=name, model_name=model.label,
                 metadata={"dlm_jax_checkpoint": progress.display_path(model.directory)}, overwrite=True)
    log.append({"site": name, "rows": int(data[name].shape[0]), "steps": result.step, "wall_s": round(result.wall_s, 1),
                "final": result.metrics, "history": result.history})
  summary = {"settings": run.settings, "layers": {r["site"]: r for r in log.records}}
  atomic_files.write_json(run.file("train.json"), summary)
  sae_figures.training_curves(summary["layers"], run.file("training.png"))
  progress.summary_banner(run.file("train.json"), "\n".join(
      f"{r['site']}: explained variance {r['final']['explained_variance']:.3f}, L0 {r['final']['l0']:.1f}, dead "
      f"{r['final']['dead_fraction']:.3f}" for r in log.records))


if __name__ == "__main__":
  cli.run(main)
