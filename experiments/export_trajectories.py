r"""Export trajectory datasets: per (item, step, position) the token, confidence, entropy and captured activations.

  python -m experiments.export_trajectories                          # tiny-dlm, residual stream, every step
  python -m experiments.export_trajectories --checkpoints=tiny-dlm,tiny-moe-dlm --n_prompts=256 \
      --sites=hook_resid_post,blocks.2.hook_mlp_out --export_steps=every:2 --position_classes=masked,decoded
  python -m experiments.export_trajectories --checkpoints=llada=/ckpt/llada-8b-instruct --task=gsm8k_test.jsonl \
      --gen_length=128 --steps=128 --block_length=32 --export_steps=every:8 --dtype=bfloat16 --batch_size=4

Each model decodes the prompts as usual (task, prompts, decoding flags as in the other analysis binaries) with
the --sites captured unreduced at the --export_steps, and writes one dataset per model,
<output_dir>/<model>/ (`dlm_jax.io.trajectory_dataset`: manifest.json + one .npy per column and shard, readable
with NumPy alone): a row per (item, kept step, position of a kept --position_classes), with the columns of
`dlm_jax.analysis.trajectories.batch_rows` (step, progress, position, position class, token, final token,
predicted token, confidence, entropy, decode step, decoded_next, the item's answer correctness) and one
float32 column per captured site (blocks.{l}.<kind>). One shard per batch of --batch_size prompts: memory is
the captures of two batches at most (while shard k is built and written, batch k + 1 is already sampling;
JAX dispatches it asynchronously), whatever --n_prompts. The manifest records the settings and the
checkpoint's identity (SHA-256 of config.json and of every weight file); running the same command again
resumes after the last finished shard and gives the same bytes as an uninterrupted run (each shard is one
fixed batch); other settings or another model in the directory are refused in one line; --max_items_this_run=N
stops after N new shards. --capture_budget_gb: the capture plan's bytes per sampler call are printed before
any model runs, and a plan over the budget is refused.

Samplers: the masked-diffusion ones (llada, mmada, dream), whose position classes follow from the step each
position is decoded at (`dlm_jax.analysis.trajectories`).
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import numpy as np
from absl import flags

from dlm_jax.analysis import trajectories
from dlm_jax.instrument import sites as site_names
from dlm_jax.instrument.hook_spec import Steps
from dlm_jax.io import output_dir
from dlm_jax.io.trajectory_dataset import TrajectoryDatasetError, TrajectoryWriter
from dlm_jax.model import init_params
from dlm_jax.session import checkpoint_bundle, decode_settings, size_limits
from dlm_jax.session.decode_settings import DecodeSettings
from experiments.common import (analysis_flags, capture_budget, checkpoints, cli, decoding, devices, flag_checks,
                                item_batches, items, numerics, numerics_flags, progress, prompts, scoring)
from experiments.common.items import TaskSettings
from experiments.common.numerics import Numerics

_CHECKPOINTS = flags.DEFINE_list("checkpoints", ["tiny-dlm"], f"Checkpoints ([label=]DIR or "
                                 f"{', '.join(checkpoints.NAMES)}); one dataset each.")
_N_PROMPTS = flags.DEFINE_integer("n_prompts", 64, "Prompts per model (0 = the whole task).")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 8, "Prompts per sampler call and per shard.")
_SITES = flags.DEFINE_list("sites", ["hook_resid_post"], "Sites captured: kinds (every layer) or full names "
                           "(blocks.1.hook_resid_post, ln_final.hook_normalized).")
_EXPORT_STEPS = flags.DEFINE_string("export_steps", "all", "Steps (model calls) exported: all, every:K, or "
                                    "comma-separated step numbers.")
_CLASSES = flags.DEFINE_list("position_classes", ["masked", "decoded", "committed"],
                             "Position classes exported (prompt, masked, decoded, committed); prompt rows repeat "
                             "every prompt position at every step.")

SAMPLERS = ("llada", "mmada", "dream")


def parse_steps(text: str) -> Steps:
  """--export_steps as `Steps`: "all", "every:K" or "0,4,8" (a one-line UserError otherwise)."""
  text = text.strip()
  try:
    if text == "all":
      return Steps.every_step()
    if text.startswith("every:"):
      return Steps.every(int(text[len("every:"):]))
    return Steps.at_steps(*[int(s) for s in text.split(",")])
  except ValueError:
    raise cli.UserError(f"--export_steps={text}: expected all, every:K (K >= 1) or distinct comma-separated step "
                        "numbers >= 0") from None


@dataclasses.dataclass(frozen=True)
class Settings:
  """Everything that defines an export (recorded in each dataset's manifest)."""

  checkpoints: tuple[str, ...]
  n_prompts: int
  batch_size: int
  sites: tuple[str, ...]
  export_steps: str
  position_classes: tuple[str, ...]
  task: TaskSettings
  decode: DecodeSettings
  numerics: Numerics

  def __post_init__(self):
    flag_checks.checkpoints_given(self.checkpoints)
    flag_checks.positive(batch_size=self.batch_size)
    flag_checks.item_count(n_prompts=self.n_prompts)
    size_limits.check(n_prompts=self.n_prompts, batch_size=self.batch_size)
    parse_steps(self.export_steps)
    if not self.sites:
      raise cli.UserError("--sites is empty; name at least one site (e.g. hook_resid_post)")
    for site in self.sites:
      try:
        site_names.parse(site)
      except ValueError as error:
        raise cli.UserError(f"--sites: {error}") from None
    bad = [c for c in self.position_classes if c not in trajectories.CLASS_CODES]
    if bad or not self.position_classes:
      raise cli.UserError(f"--position_classes={','.join(self.position_classes)}: expected some of "
                          f"{', '.join(trajectories.CLASS_CODES)}")

  @property
  def steps(self) -> Steps:
    return parse_steps(self.export_steps)

  def hooks(self):
    return trajectories.trajectory_hooks(self.sites, self.steps)

  def check_model(self, model: checkpoint_bundle.Model) -> None:
    if model.sampler not in SAMPLERS:
      raise cli.UserError(f"{model.label}: sampler {model.sampler}; trajectory exports run the masked-diffusion "
                          f"samplers {', '.join(SAMPLERS)}")
    try:
      self.hooks().check(model.config)
    except ValueError as error:
      raise cli.UserError(f"--sites: {model.label}: {error}") from None


def site_columns(settings: Settings, model: checkpoint_bundle.Model) -> dict[str, tuple[str, tuple[int, ...]]]:
  """{captured site name: ("float32", feature shape)} of the exported sites, in capture order."""
  hooks, config = settings.hooks(), model.config
  out = {}
  for capture in hooks.captures:
    if capture.site == trajectories.READOUT_SITE and trajectories.READOUT_SITE not in settings.sites:
      continue
    for layer, name in zip(hooks.resolved_layers(config, capture),
                           capture.names(hooks.resolved_layers(config, capture))):
      out[name] = ("float32", site_names.feature_shape(config, capture.site, layer))
  return out


def _plan_check(settings: Settings, model: checkpoint_bundle.Model, values: dict, batch: item_batches.Batch,
                runtime: devices.Runtime) -> None:
  """Prints the capture bytes of one sampler call and refuses a plan over the budget or one that keeps no
  step of this run; abstract (the weights are not read)."""
  hooks = settings.hooks()
  # The sampler is bound outside the abstract evaluation, so the prompt stays concrete (Dream's family reads
  # it on the host); only the weights are abstract.
  bound = decoding.sampler(model, values, batch.prompts, runtime, settings.numerics, key=batch.key)

  def run():
    params = init_params(model.config, jax.random.key(0), settings.numerics.weight_dtype)
    return bound.func(params, *bound.args[1:], **bound.keywords, hooks=hooks)

  try:
    capture_budget.check(run, f"{model.label} ({len(hooks.capture_names(model.config))} sites)",
                         "export fewer --sites or --export_steps (every:K), or a smaller --batch_size")
  except ValueError as error:
    raise cli.UserError(f"--export_steps={settings.export_steps}: {model.label}: {error}") from None


def score_answers(model: checkpoint_bundle.Model, batch_items: list, generated: np.ndarray) -> np.ndarray:
  """[b] int8: 1 when the item's completion is scored correct, else 0."""
  chat = model.prompt_format == "chat"
  return np.asarray([int(scoring.score(item, prompts.completion(model, generated[r])[1], chat)["correct"])
                     for r, item in enumerate(batch_items)], np.int8)


def launch_batch(settings: Settings, model: checkpoint_bundle.Model, values: dict, batch: item_batches.Batch,
                 runtime: devices.Runtime) -> tuple:
  """Starts one batch's sampling with the captures and its readout (JAX dispatches both asynchronously, so the
  host can write the previous shard meanwhile); returns what `batch_shard` needs."""
  trace = decoding.sampler(model, values, batch.prompts, runtime, settings.numerics, key=batch.key)(
      hooks=settings.hooks())
  readout = trajectories.step_readout(model.params, trace.captures[trajectories.READOUT_SITE], config=model.config)
  return batch, trace, readout


def batch_shard(settings: Settings, model: checkpoint_bundle.Model, launched: tuple,
                item_index: dict[str, int]) -> dict[str, np.ndarray]:
  """The rows of a launched batch (`launch_batch`; `trajectories.batch_rows`), its answers scored."""
  batch, trace, readout = launched
  decoding.check_finite(trace, [f"{model.label} batch row {r}" for r in range(batch.prompts.ids.shape[0])])
  lp = batch.prompts.ids.shape[1]
  tokens = np.asarray(trace.tokens)
  names = site_columns(settings, model)
  valid = np.ones(batch.prompts.ids.shape, bool) if batch.prompts.mask is None else np.asarray(batch.prompts.mask)
  return trajectories.batch_rows(
      tokens=tokens, decode_step=np.asarray(trace.decode_step), prompt_valid=valid,
      steps=np.asarray(trace.capture_steps[trajectories.READOUT_SITE]), row_nfe=np.asarray(trace.row_nfe),
      active_rows=np.asarray(trace.active_rows), computed_queries=np.asarray(trace.computed_queries),
      readout=tuple(np.asarray(a) for a in readout),
      activations={name: np.asarray(trace.captures[name]) for name in names},
      classes=settings.position_classes, mask_id=int(model.config.mask_token_id),
      items=np.asarray([item_index[i.id] for i in batch.items]),
      correct=score_answers(model, batch.items, tokens[:len(batch.items), lp:]))


def columns(settings: Settings, model: checkpoint_bundle.Model) -> dict:
  """The dataset's columns: the row columns, then the sites."""
  return {**trajectories.ROW_COLUMNS, **site_columns(settings, model)}


def export_model(settings: Settings, model: checkpoint_bundle.Model, runtime: devices.Runtime, path: str,
                 max_shards: int = 0) -> TrajectoryWriter:
  """Writes (or resumes) the model's dataset at `path`; stops after `max_shards` new shards (0: no limit;
  --max_items_this_run counts shards here)."""
  values = decode_settings.model_settings(settings.decode, model)
  todo = items.load_items(items.task_name(settings.task.task, model.record), settings.n_prompts,
                          settings.task.data_seed)
  item_index = {item.id: i for i, item in enumerate(todo)}
  record = {"settings": dataclasses.asdict(settings), "decoding": values, "sampler": model.sampler,
            "item_ids": [item.id for item in todo],
            "position_class_codes": trajectories.CLASS_CODES, "mask_id": int(model.config.mask_token_id),
            "n_layers": model.config.n_layers}
  try:
    writer = TrajectoryWriter(path, model=checkpoints.identity(model.directory), settings=record,
                              columns=columns(settings, model),
                              expected_shards=math.ceil(len(todo) / settings.batch_size))
  except TrajectoryDatasetError as error:
    raise cli.UserError(f"{error}; use the same flags, another --output_dir, or --overwrite") from None
  done = lambda item: item_index[item.id] // settings.batch_size < writer.shards_done
  meter = progress.Progress(f"{model.label} shards", writer.manifest["expected_shards"], writer.shards_done)
  todo_batches = list(item_batches.batches(todo, prompts.encode(model, todo), settings.batch_size,
                                           settings.decode.seed, runtime, done))
  if max_shards:
    todo_batches = todo_batches[:max_shards]
  pending = None
  for batch in [*todo_batches, None]:  # batch k + 1 is sampled while shard k is built and written
    launched = None if batch is None else launch_batch(settings, model, values, batch, runtime)
    if pending is not None:
      shard = batch_shard(settings, model, pending, item_index)
      writer.write_shard(item_index[pending[0].items[0].id] // settings.batch_size, shard)
      meter.update(1, f"{len(shard['step'])} rows")
    pending = launched
  return writer


def main(argv):
  del argv
  shared = analysis_flags.from_flags("export_trajectories", _CHECKPOINTS)
  models = shared.prepare_models()
  runtime = devices.init_runtime(shared.runtime)
  settings = Settings(checkpoints=shared.checkpoints, n_prompts=_N_PROMPTS.value, batch_size=_BATCH_SIZE.value,
                      sites=tuple(_SITES.value), export_steps=_EXPORT_STEPS.value,
                      position_classes=tuple(_CLASSES.value), task=shared.task, decode=shared.decode,
                      numerics=numerics_flags.from_flags(shared.runtime))
  out = shared.output.output_dir
  if os.path.exists(out) and not os.path.isdir(out):
    raise cli.UserError(f"--output_dir={out} is a file; expected a directory")
  try:
    output_dir.check_not_over_sources(out, [m.directory for m in models])
  except ValueError as error:
    raise cli.UserError(f"--output_dir={out}: {error}") from None
  for model in models:
    settings.check_model(model)
    values = decode_settings.model_settings(shared.decode, model)
    todo = items.load_items(items.task_name(settings.task.task, model.record), settings.n_prompts,
                            settings.task.data_seed)
    first = next(item_batches.batches(todo, prompts.encode(model, todo), settings.batch_size, settings.decode.seed,
                                      runtime, lambda item: False))
    _plan_check(settings, model, values, first, runtime)
  for model in models:
    path = os.path.join(out, model.label)
    if shared.output.overwrite and os.path.exists(path):
      output_dir.remove(path)
    model = checkpoints.load_weights(model, runtime, settings.numerics)
    writer = export_model(settings, model, runtime, path, shared.output.max_items_this_run)
    rows = sum(s["rows"] for s in writer.manifest["shards"])
    print(f"{model.label}: {rows} rows in {writer.shards_done}/{writer.manifest['expected_shards']} shards at "
          f"{progress.display_path(path)}" + ("" if writer.complete else " (unfinished; run again to resume)"),
          flush=True)


if __name__ == "__main__":
  cli.run(main)
