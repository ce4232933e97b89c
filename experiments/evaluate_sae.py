r"""Where in layers × denoising steps an SAE costs least: reconstruction quality and the cost of splicing it in,
per (layer, step bin).

  python -m experiments.evaluate_sae --sae_run=results/sae_tiny_dlm --output_dir=results/sae_tiny_dlm_eval
  python -m experiments.evaluate_sae --saes=/sae/blocks.1.hook_resid_post,/sae/blocks.3.hook_resid_post \
      --checkpoint=tiny-dlm --n=100 --step_bin=8

SAEs: SAELens directories (--saes), or every SAE a train_sae run saved (--sae_run); each must name its hook
(cfg.json's metadata.hook_name) and fit that site of the model (one line otherwise, before any model work).

1. Clean run: the model's sampler (temperature 0, steps = gen_length, one block) on --n problems of the
   synthetic task's test split, capturing each SAE's site at every step. Reconstruction metrics of each SAE on
   those activations, per step bin and position class (masked / decoded / all generated):
   `dlm_jax.analysis.sae_metrics.reconstruction_metrics` (MSE, explained variance, L0, dead features).
2. Spliced runs: one compiled sampler program holds an `Edit(site, "sae_splice")` per SAE and the lens capture
   at ln_final.hook_normalized (positions still masked, targets = the clean run's final tokens); each condition
   (an SAE spliced during one step bin, or during every step, or nothing) only changes the edits' traced step
   windows. Per condition: exact-match accuracy and, per step, the cross-entropy of the clean final tokens at
   the masked positions (`sae_metrics.masked_cross_entropy`). ΔCE of (site, bin) is the mean over the bin's steps
   of CE(spliced) − CE(nothing spliced); Δaccuracy the difference of exact match.

Outputs in --output_dir: conditions.jsonl (one line per condition and batch of problems: resumable), results.json
(the grids and the per-step CE), grid.png (ΔCE, Δaccuracy, explained variance and the fraction of features unused,
per site × bin).
"""

from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp
import numpy as np
from absl import flags

from dlm_jax.analysis import sae_metrics
from dlm_jax.instrument import sites
from dlm_jax.instrument.hook_call import CaptureValues, hook_values
from dlm_jax.instrument.hook_spec import Capture, Edit, Hooks
from dlm_jax.io import saelens
from dlm_jax.runtime import distributed
from dlm_jax.session import decode_settings
from experiments.common import (atomic_files, checkpoints, cli, decoding, devices, flag_checks, item_batches, items,
                                numerics, numerics_flags, output_flags, progress, prompts, run_dir, runtime_flags,
                                sae_runs, scoring)
from experiments.reports import sae_figures

_CHECKPOINT = flags.DEFINE_string("checkpoint", "tiny-dlm", "Converted checkpoint directory, or tiny-dlm, ...")
_SAES = flags.DEFINE_list("saes", [], "SAELens SAE directories.")
_SAE_RUN = flags.DEFINE_string("sae_run", None, "An experiments.train_sae output directory: evaluate its SAEs.")
_N = flags.DEFINE_integer("n", 64, "Problems of the synthetic test split.")
_DATA_SEED = flags.DEFINE_integer("data_seed", 0, "Seed of the synthetic generator.")
_GEN_LENGTH = flags.DEFINE_integer("gen_length", 32, "Generated positions.")
_STEPS = flags.DEFINE_integer("steps", None, "Diffusion steps (default: gen_length).")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 64, "Prompts per sampler call (results do not depend on it).")
_STEP_BIN = flags.DEFINE_integer("step_bin", 4, "Steps per bin.")

CLASSES = ("masked", "decoded", "generated")


def _sae_dirs() -> list[str]:
  if bool(_SAES.value) == bool(_SAE_RUN.value):
    raise cli.UserError("give exactly one of --saes (SAE directories) and --sae_run (a train_sae output directory)")
  if _SAES.value:
    return list(_SAES.value)
  root = os.path.join(_SAE_RUN.value, "saes")
  if not os.path.isdir(root) or not os.listdir(root):
    raise cli.UserError(f"--sae_run={_SAE_RUN.value}: no SAEs in {root} (expected a finished experiments.train_sae "
                        "output directory)")
  return [os.path.join(root, name) for name in sorted(os.listdir(root))]


def _load_saes(config) -> dict[str, saelens.SAEFile]:
  loaded = {}
  for path in _sae_dirs():
    try:
      sae_file = saelens.load(path)
      if sae_file.hook_name is None:
        raise saelens.SAEFileError(f"{path}: cfg.json names no hook (metadata.hook_name); it cannot be placed")
      saelens.check_site(sae_file, config, sae_file.hook_name)
    except (saelens.SAEFileError, ValueError) as e:
      raise cli.UserError(str(e)) from None
    if sae_file.hook_name in loaded:
      raise cli.UserError(f"{path}: a second SAE for {sae_file.hook_name} (one SAE per site)")
    loaded[sae_file.hook_name] = sae_file
  return loaded


def _splice_program(names: list[str]) -> Hooks:
  return Hooks(edits=tuple(Edit(name, "sae_splice") for name in names),
               captures=(Capture("ln_final.hook_normalized", reduce="lens", k=1, positions="masked"),))


def _conditions(names: list[str], bins: list[tuple[int, int]], n_steps: int) -> list[tuple[str, str | None, tuple]]:
  """(condition label, spliced site or None, step window)."""
  out = [("clean", None, (0, 0))]
  for name in names:
    out += [(f"{name}@{a}-{b}", name, (a, b)) for a, b in bins] + [(f"{name}@all", name, (0, n_steps))]
  return out


def _reconstruction(saes, clean: sae_runs.Activations, bins) -> dict[str, dict]:
  out = {}
  for name, sae_file in saes.items():
    per_bin = {}
    for a, b in [*bins, (0, int(clean.step.max()) + 1)]:
      in_bin = (clean.step >= a) & (clean.step < b)
      per_class = {}
      for cls, rows in (("masked", in_bin & clean.masked), ("decoded", in_bin & ~clean.masked),
                        ("generated", in_bin)):
        if rows.any():
          per_class[cls] = sae_metrics.reconstruction_metrics(sae_file.sae, clean.values[name][rows])
      per_bin[f"{a}-{b}"] = per_class
    out[name] = per_bin
  return out


def main(argv):
  del argv
  runtime_settings = runtime_flags.from_flags()
  output = output_flags.from_flags("evaluate_sae")
  flag_checks.positive(n=_N.value, batch_size=_BATCH_SIZE.value, gen_length=_GEN_LENGTH.value,
                       step_bin=_STEP_BIN.value)
  model = checkpoints.prepare(_CHECKPOINT.value, "auto", "training")
  saes = _load_saes(model.config)
  names = sorted(saes, key=lambda n: (sites.parse(n)[1], n))
  decode = decode_settings.DecodeSettings(gen_length=_GEN_LENGTH.value, steps=_STEPS.value,
                                          block_length=_GEN_LENGTH.value)
  values = decode_settings.model_settings(decode, model)
  settings = {"checkpoint": checkpoints.identity(model.directory), "n": _N.value, "data_seed": _DATA_SEED.value,
              "decode": values, "step_bin": _STEP_BIN.value,
              "saes": {name: {"path": progress.display_path(saes[name].path),
                              "architecture": saes[name].sae.architecture, "d_sae": saes[name].sae.d_sae}
                       for name in names}}
  run = run_dir.RunDir(output.output_dir, settings, overwrite=output.overwrite,
                       inputs=[model.directory, *(saes[n].path for n in names)])
  runtime = devices.init_runtime(runtime_settings)
  numeric_settings = numerics_flags.from_flags(runtime_settings)
  model = checkpoints.load_weights(model, runtime, numeric_settings)
  problems = items.load_items("synthetic", _N.value, _DATA_SEED.value)
  prompt_set = prompts.encode(model, problems)
  by_kind: dict[str, list[int]] = {}
  for name in names:
    kind, layer = sites.parse(name)
    by_kind.setdefault(kind, []).append(layer)
  clean_parts = [sae_runs.collect(model, values, prompt_set, problems, runtime, numeric_settings, kind, tuple(layers),
                                  _BATCH_SIZE.value, decode.seed, f"{model.label} clean")
                 for kind, layers in by_kind.items()]
  clean = dataclasses.replace(clean_parts[0], values={k: v for part in clean_parts for k, v in part.values.items()})
  n_steps = int(clean.step.max()) + 1
  bins = sae_metrics.step_bins(n_steps, _STEP_BIN.value)
  conditions = _conditions(names, bins, n_steps)
  hooks = _splice_program(names)
  log = run_dir.ResultsLog(run, "conditions.jsonl", ("condition", "batch"), budget=output.max_items_this_run)
  targets = {p.id: row for p, row in zip(problems, clean.tokens)}
  lp = prompt_set.width
  meter = progress.Progress("conditions × batches", len(conditions) * -(-len(problems) // _BATCH_SIZE.value),
                            done=len(log.records))
  try:
    for index, batch in enumerate(item_batches.batches(problems, prompt_set, _BATCH_SIZE.value, decode.seed, runtime,
                                                       lambda item: False)):
      rows = batch.prompts.ids.shape[0]
      target = item_batches.pad_rows(np.stack([targets[p.id] for p in batch.items]), rows)
      for label, site, window in conditions:
        if log.done(condition=label, batch=index):
          continue
        edits = {i: dict(sae=saes[name].sae, window=window if name == site else (0, 0)) for i, name in enumerate(names)}
        hv = hook_values(hooks, model.config, rows, target.shape[1],
                         captures={0: CaptureValues(targets=jnp.asarray(target, jnp.int32))}, edits=edits)
        trace = decoding.generate(model, values, batch.prompts, runtime, numeric_settings, key=batch.key, hooks=hooks,
                                  hook_values=hv)
        n = len(batch.items)
        generated = distributed.to_host(trace.generated)[:n]
        lens = trace.captures["ln_final.hook_normalized"]
        probability = distributed.to_host(lens.probability)[:, :n]
        ce = sae_metrics.masked_cross_entropy(probability, distributed.to_host(trace.decode_step)[:n], lp)
        correct = [scoring.score(p, prompts.completion(model, g)[1])["correct"] for p, g in zip(batch.items, generated)]
        if label == "clean" and not np.array_equal(distributed.to_host(trace.tokens)[:n], target[:n]):
          raise cli.UserError("the run without splices decoded other tokens than the clean run; the sampler is not "
                              "deterministic here")
        log.append({"condition": label, "batch": index, "items": n, "correct": int(sum(correct)),
                    "ce_sum": np.nansum(ce, axis=1).tolist(), "ce_rows": np.sum(np.isfinite(ce), axis=1).tolist()})
        meter.update(1, label)
  except run_dir.ItemBudget:
    progress.summary_banner(run.file("conditions.jsonl"), "stopped at --max_items_this_run; run again to resume")
    return
  results = _summarise(log.records, conditions, names, bins, _reconstruction(saes, clean, bins), n_steps)
  atomic_files.write_json(run.file("results.json"), {"settings": run.settings, **results})
  bin_labels = [f"{a}-{b}" for a, b in bins] + ["all"]
  recon = results["reconstruction"]
  sae_figures.layer_step_grids(
      [("ΔCE (nats) while spliced", np.array(results["delta_ce"]), True),
       ("Δ exact match", np.array(results["delta_accuracy"]), True),
       ("explained variance", np.array([[recon[n][k]["generated"]["explained_variance"] for k in
                                        [f"{a}-{b}" for a, b in bins] + [f"0-{n_steps}"]] for n in names]), False),
       ("features unused in the bin (fraction)", np.array([[recon[n][k]["generated"]["dead_fraction"] for k in
                                                             [f"{a}-{b}" for a, b in bins] + [f"0-{n_steps}"]]
                                                            for n in names]), False)],
      names, bin_labels, f"{model.label}: SAE splice cost per site and step bin ({_N.value} problems)",
      run.file("grid.png"))
  best = min(((results["delta_ce"][i][j], names[i], bin_labels[j]) for i in range(len(names))
              for j in range(len(bins))), key=lambda t: t[0])
  progress.summary_banner(run.file("results.json"), (
      f"clean exact match {results['clean_accuracy']:.3f}; cheapest splice: {best[1]} at steps {best[2]} "
      f"(ΔCE {best[0]:+.4f} nats)"))


def _summarise(records, conditions, names, bins, reconstruction, n_steps) -> dict:
  totals = {}
  for r in records:
    t = totals.setdefault(r["condition"], {"items": 0, "correct": 0, "ce_sum": np.zeros(n_steps),
                                           "ce_rows": np.zeros(n_steps)})
    t["items"] += r["items"]
    t["correct"] += r["correct"]
    t["ce_sum"] += np.asarray(r["ce_sum"])
    t["ce_rows"] += np.asarray(r["ce_rows"])
  per_step = {label: np.where(t["ce_rows"] > 0, t["ce_sum"] / np.maximum(t["ce_rows"], 1), np.nan)
              for label, t in totals.items()}
  accuracy = {label: t["correct"] / t["items"] for label, t in totals.items()}
  windows = {label: window for label, _, window in conditions}
  delta_ce, delta_accuracy = [], []
  for name in names:
    ce_row, acc_row = [], []
    for label in [f"{name}@{a}-{b}" for a, b in bins] + [f"{name}@all"]:
      a, b = windows[label]
      ce_row.append(float(np.nanmean(per_step[label][a:b] - per_step["clean"][a:b])))
      acc_row.append(accuracy[label] - accuracy["clean"])
    delta_ce.append(ce_row)
    delta_accuracy.append(acc_row)
  return {"sites": names, "bins": [list(b) for b in bins], "clean_accuracy": accuracy["clean"],
          "accuracy": accuracy, "cross_entropy_per_step": {k: v.tolist() for k, v in per_step.items()},
          "delta_ce": delta_ce, "delta_accuracy": delta_accuracy, "reconstruction": reconstruction}


if __name__ == "__main__":
  cli.run(main)
