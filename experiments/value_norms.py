r"""Value-vector norms of sink and normal tokens during generation (Zhang et al., paper B Fig. 1), for any
checkpoint.

  python -m experiments.value_norms                          # the embedded tiny DLM and ARM
  python -m experiments.value_norms --checkpoints=tiny-dlm,tiny-arm,smollm2
  python -m experiments.value_norms --checkpoints=llada=/ckpt/llada-8b-instruct --task=gsm8k_test.jsonl \
      --gen_length=128 --steps=128 --block_length=32 --layers=8,16,24 --dtype=bfloat16

At every step of every generation it records, per layer, the incoming attention of every key per query
head and the L2 norm of every key's value vector per kv head. A (step, layer, head, key) is a sink when its
relative score passes the ε-rule (`dlm_jax.analysis.sinks`, as in experiments.sink_analysis); its value norm is the
norm of the kv head that query head reads (`sinks.value_norm_samples`). Up to --samples_per_item norms of
each class are kept per prompt (a seeded subsample) together with exact per-layer means.

Tasks and prompts: `experiments.common.items`, `experiments.common.prompts`; decoding defaults (they differ from
`experiments.generate`'s official ones) and --padding: `dlm_jax.session.decode_settings`; per-item PRNG keys:
`experiments.common.decoding`. An item's results do not depend on --batch_size or on the items sharing its batch.
run.json records the settings (a resume with other settings is refused); nothing is written before the first
result.

Outputs in --output_dir (default results/value_norms): results.jsonl (one line per model and prompt),
<model>/fig1_value_norms.png (histograms of sink and normal norms), <model>/value_norms_per_layer.png,
summary.json, summary.md (against the paper: LLaDA sinks ≈ 2–2.5 vs normal ≈ 7–8; Dream ≈ 3 vs 7–8.5).
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
from absl import flags

from dlm_jax.analysis import sinks
from dlm_jax.runtime import distributed
from dlm_jax.instrument.stats import StatsSpec
from dlm_jax.session import checkpoint_bundle, decode_settings, size_limits
from dlm_jax.session.decode_settings import DecodeSettings
from experiments.common import (analysis_flags, atomic_files, checkpoints, cli, decoding, devices, flag_checks,
                                item_batches, items, model_runs, numerics, numerics_flags, progress, prompts, run_dir,
                                validity)
from experiments.reports import plots, summary_files
from experiments.common.items import TaskSettings
from experiments.common.numerics import Numerics
from dlm_jax.instrument import sink_selection
from experiments.reports import palette

_CHECKPOINTS = flags.DEFINE_list("checkpoints", ["tiny-dlm", "tiny-arm"],
                                 f"Checkpoints ([label=]DIR or {', '.join(checkpoints.NAMES)}).")
_N_PROMPTS = flags.DEFINE_integer("n_prompts", 8, "Prompts per model (0 = the whole task).")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 8, "Prompts per sampler call (results do not depend on it).")
_EPSILON = flags.DEFINE_float("epsilon", 3.0, "ε of the sink rule, > 0.")
_LAYERS = flags.DEFINE_list("layers", [], "Layers to record (default: all).")
_SAMPLES_PER_ITEM = flags.DEFINE_integer("samples_per_item", 2000, "Norms of each class kept per prompt for the "
                                         "histogram.")
_MAX_POINTS = flags.DEFINE_integer("max_points", 10000, "Norms per class in the histogram (the paper shows "
                                   "10K).")


@dataclasses.dataclass(frozen=True)
class Settings:
  """Everything that defines a value_norms run (recorded in run.json; flags of the same names)."""

  checkpoints: tuple[str, ...]
  n_prompts: int
  batch_size: int
  epsilon: float
  layers: tuple[int, ...] | None
  samples_per_item: int
  max_points: int
  task: TaskSettings
  decode: DecodeSettings
  numerics: Numerics

  def __post_init__(self):
    flag_checks.checkpoints_given(self.checkpoints)
    flag_checks.positive(batch_size=self.batch_size, samples_per_item=self.samples_per_item,
                         max_points=self.max_points)
    flag_checks.item_count(n_prompts=self.n_prompts)
    size_limits.check(n_prompts=self.n_prompts, batch_size=self.batch_size, samples_per_item=self.samples_per_item,
                      max_points=self.max_points)
    flag_checks.above_zero(epsilon=self.epsilon)
    flag_checks.layer_indices(self.layers)

  def check_model(self, model: checkpoint_bundle.Model) -> None:
    """Refuses layers the model does not have, and models with sliding and global layers (DiffusionGemma),
    whose value norms the library does not return (their kv heads differ by layer kind)."""
    if model.config.layer_pattern is not None:
      raise cli.UserError(f"{model.label} has sliding and global layers (layer_pattern "
                          f"{model.config.layer_pattern!r}); value norms are not available for such models")
    flag_checks.layers_of_model(self.layers, model.label, model.config.n_layers)


def analyse_row(settings: Settings, model, item, batch: prompts.Prompts, host, row: int) -> dict:
  """One prompt's sink / normal value norms: per-layer sums and counts plus seeded subsamples."""
  lp = batch.ids.shape[1]
  incoming = np.asarray(host["incoming"][:, :, row], np.float32)  # [steps, L', N, S], over the real queries
  norms = np.asarray(host["values"][:, :, row], np.float32)  # [steps, L', K, S]
  valid, _ = validity.step_validity(model, batch, row, host["tokens"][row], incoming.shape[0], host["queries"])
  valid4 = valid[:, None, None, :]
  scores = sinks.relative_scores(incoming, valid4)
  sink_mask = np.asarray(sink_selection.epsilon_rule(scores, settings.epsilon, "sum", valid4))  # [steps, L', N, S]
  group = incoming.shape[2] // norms.shape[2]
  paired = np.repeat(norms, group, axis=2)  # [steps, L', N, S]: the kv head each query head reads
  keep = np.broadcast_to(valid4, sink_mask.shape)
  is_sink, is_normal = sink_mask & keep, ~sink_mask & keep
  rng = np.random.default_rng([settings.decode.seed, int(decoding.item_key_number(item.id))])

  def subsample(values):
    if values.size <= settings.samples_per_item:
      return values
    return rng.choice(values, settings.samples_per_item, replace=False)

  axes = (0, 2, 3)
  return {
      "model": model.label, "item": item.id,
      "sink_sum": (paired * is_sink).sum(axes), "sink_count": is_sink.sum(axes),
      "normal_sum": (paired * is_normal).sum(axes), "normal_count": is_normal.sum(axes),
      "sink_samples": np.round(subsample(paired[is_sink]), 4),
      "normal_samples": np.round(subsample(paired[is_normal]), 4),
      "completion": prompts.completion(model, host["tokens"][row][lp:])[1],
  }


def run_model(settings: Settings, model, runtime: devices.Runtime, log: run_dir.ResultsLog) -> dict:
  """Generates and analyses the model's prompts not done yet; returns its metadata for the report."""
  spec = StatsSpec(incoming_attention=True, per_head=True, layers=settings.layers, value_norms=True)
  todo = items.load_items(items.task_name(settings.task.task, model.record), settings.n_prompts,
                          settings.task.data_seed)
  prompt_set = prompts.encode(model, todo)
  values = decode_settings.model_settings(settings.decode, model)
  done = lambda item: log.done(model=model.label, item=item.id)
  meter = progress.Progress(f"{model.label} prompts", len(todo), sum(map(done, todo)))
  for batch in item_batches.batches(todo, prompt_set, settings.batch_size, settings.decode.seed, runtime,
                                    done):
    trace = decoding.generate(model, values, batch.prompts, runtime, settings.numerics, key=batch.key,
                              stats_spec=spec)
    host = distributed.to_host({"tokens": trace.tokens, "queries": trace.computed_queries,
                                "incoming": trace.stats["incoming_attention"],
                                "values": trace.stats["value_norms"]})
    for row, item in enumerate(batch.items):
      if not done(item):
        meter.update(int(log.append(analyse_row(settings, model, item, batch.prompts, host, row))))
  layers = settings.layers if settings.layers is not None else range(model.config.n_layers)
  return {"label": model.label, "directory": progress.display_path(model.directory), "sampler": model.sampler,
          "layers": list(layers), "settings": values}


def write_report(settings: Settings, out: str, metas: list[dict], records: list[dict], wall_s: float) -> str:
  """Writes the figures, summary.json and summary.md; returns the markdown."""
  lines = ["# Value norms of sink and normal tokens (Zhang et al. Fig. 1): `experiments.value_norms`", "",
           f"Sinks: (step, layer, head, key) passing the ε-rule with ε = {settings.epsilon:g} on relative incoming "
           "attention; each query head is paired with the value norm of the kv head it reads. Wall time "
           f"{wall_s:.0f}s.", "", "| model | sink tokens | normal tokens | mean sink norm | mean normal norm | ratio |",
           "|---|---|---|---|---|---|"]
  summary = {}
  for meta in metas:
    rows = [r for r in records if r["model"] == meta["label"]]
    if not rows:
      continue
    sink_sum, sink_count = np.sum([r["sink_sum"] for r in rows], 0), np.sum([r["sink_count"] for r in rows], 0)
    normal_sum, normal_count = np.sum([r["normal_sum"] for r in rows], 0), np.sum([r["normal_count"] for r in rows], 0)
    with np.errstate(invalid="ignore", divide="ignore"):
      sink_layer, normal_layer = sink_sum / sink_count, normal_sum / normal_count
    sink_mean = float(sink_sum.sum() / max(sink_count.sum(), 1)) if sink_count.sum() else float("nan")
    normal_mean = float(normal_sum.sum() / max(normal_count.sum(), 1))
    summary[meta["label"]] = {"sink_mean": sink_mean, "normal_mean": normal_mean, "sink_count": int(sink_count.sum()),
                              "normal_count": int(normal_count.sum()), "layers": meta["layers"],
                              "sink_mean_per_layer": sink_layer, "normal_mean_per_layer": normal_layer}
    lines.append(f"| {meta['label']} | {int(sink_count.sum())} | {int(normal_count.sum())} | {sink_mean:.3f} | "
                 f"{normal_mean:.3f} | {sink_mean / normal_mean:.2f} |")
    model_dir = os.path.join(out, meta["label"])
    rng = np.random.default_rng(settings.decode.seed)
    samples = {"normal tokens": np.concatenate([r["normal_samples"] for r in rows]),
               "sinks": np.concatenate([r["sink_samples"] for r in rows])}
    samples = {k: rng.choice(v, settings.max_points, replace=False) if v.size > settings.max_points else v
               for k, v in samples.items()}  # at most --max_points per class, as the paper's 10K
    histogram = plots.value_norm_histogram(samples, {"normal tokens": palette.NORMAL, "sinks": palette.SINK},
                                         f"{meta['label']}: value norms of sink and normal tokens")
    atomic_files.save_figure(histogram, os.path.join(model_dir, "fig1_value_norms.png"))
    bars = plots.grouped_bars([str(l) for l in meta["layers"]],
                              {"sinks": np.nan_to_num(sink_layer), "normal tokens": normal_layer},
                              f"{meta['label']}: mean value norm per layer", "‖v‖₂",
                              colours={"sinks": palette.SINK, "normal tokens": palette.NORMAL})
    atomic_files.save_figure(bars, os.path.join(model_dir, "value_norms_per_layer.png"))
  lines += ["", "Per layer (mean value norm, sinks / normal):", ""]
  for label, s in summary.items():
    per_layer = ", ".join(f"L{l}: {a:.2f}/{b:.2f}" for l, a, b in zip(s["layers"], s["sink_mean_per_layer"],
                                                                       s["normal_mean_per_layer"]))
    lines.append(f"- **{label}**: {per_layer}")
  lines += ["", "Paper (Fig. 1, 10K sink vs 10K normal tokens during inference; values read off the plot): "
            "LLaDA-8B-Instruct sinks ≈ 2–2.5 vs normal ≈ 7–8; Dream-7B-Instruct sinks ≈ 3 (a minority 4.5–6) vs "
            "normal ≈ 7–8.5. Low-norm sinks make attending to them close to a no-op.", ""]
  for label in summary:
    lines.append(f"- [{label}/fig1_value_norms.png]({label}/fig1_value_norms.png), "
                 f"[{label}/value_norms_per_layer.png]({label}/value_norms_per_layer.png)")
  return summary_files.write(out, {"models": metas, "summary": summary, "wall_s": wall_s}, lines)


def main(argv):
  del argv
  shared = analysis_flags.from_flags("value_norms", _CHECKPOINTS)
  models = shared.prepare_models()
  runtime = devices.init_runtime(shared.runtime)
  layers = cli.int_list(_LAYERS.value, "layers") or None
  settings = Settings(checkpoints=shared.checkpoints, n_prompts=_N_PROMPTS.value, batch_size=_BATCH_SIZE.value,
                      epsilon=_EPSILON.value, layers=layers, samples_per_item=_SAMPLES_PER_ITEM.value,
                      max_points=_MAX_POINTS.value, task=shared.task, decode=shared.decode,
                      numerics=numerics_flags.from_flags(shared.runtime))
  for model in models:
    settings.check_model(model)
    decode_settings.model_settings(shared.decode, model)
  runs = model_runs.run_models(shared.output, settings, models, runtime, shared.task.task, run_model)
  if runs is not None:
    progress.summary_banner(runs.out.path, write_report(settings, runs.out.path, runs.metas, runs.log.records,
                                                        runs.seconds))


if __name__ == "__main__":
  cli.run(main)
