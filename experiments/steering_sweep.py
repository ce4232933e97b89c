r"""Steering along the denoising clock on a schedule: coefficients × schedules, with the per-step effect on
confidence, entropy and the answer.

  python -m experiments.steering_sweep                   # tiny-dlm and tiny-moe-dlm, synthetic task
  python -m experiments.steering_sweep --checkpoints=tiny-dlm --coefficients=-2,0,2 \
      --schedules=constant,window:0-8,gated --layer=2 --scope=masked --n_bins=4

Per model: (1) calibration: the prompts decode unsteered while the mean residual stream (hook_resid_post)
over the still-masked positions is captured at --layer (and --layer − 1) at every step; μ per step bin
(--n_bins equal spans of steps) pooled over prompts; the clock direction of bin k is μ[t̂] − μ[k], t̂ the
--clock_target bin (`dlm_jax.analysis.clock_steering`; Subliminal Clocks adds α·(μ[t̂] − μ[t]) at masked
positions). (2) sweep: for every schedule and coefficient α the same prompts decode with the scheduled edit
value + α · c_t · g · (μ[t̂] − μ[bin t]) at the --scope positions of --layer, inside the compiled sampler
(`dlm_jax.instrument.step_schedule`: one program per model for the ungated schedules, one for the gated), and
the final-normed hidden state of every step is captured: per step, the mean confidence (largest probability)
and entropy of the predictions at the still-masked positions, and the answer (tokens, completion, correct).
The calibration uses the same prompts as the sweep.

--schedules (c_t per step t of the run's n steps): constant (1 at every step); first_half / second_half (1 at
steps [0, n/2) / [n/2, n)); window:A-B (1 at steps [A, B)); table:c0/c1/... (c_t per step, 0 after the
table); gated (1 at every step, times g = sigmoid(−4 (r − m) / Δ) at each position, r the projection of
layer --layer − 1's residual on the unit clock direction u of that layer (last bin − first bin), m the
midpoint and Δ the distance of the first and last bins' means along u: g ≈ 0.88 where the probe reads the
first bin, ≈ 0.12 where it reads the last — steering the positions the clock still reads as early). A
schedule that names a step the sampler never runs is refused before any model work. --coefficients must
include 0, the unsteered baseline (bitwise the plain run). --direction=random replaces each bin's clock vector
by a random direction of the same norm (a control: does the clock direction do more than any perturbation of
that size?).

Outputs in --output_dir (default results/steering_sweep): results.jsonl (one line per model, schedule,
coefficient and prompt: per step the masked positions read, their mean confidence and entropy; the tokens,
completion and whether it is correct), <model>/clock.npz (the bin means and clock vectors), summary.json,
summary.md and per model <model>/confidence_per_step.png, <model>/entropy_per_step.png (steps on x, one panel
per schedule, one line per coefficient) and <model>/example_answers.png (one prompt's answer tokens per
coefficient of the first schedule). Resumes; run.json records the settings.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np
from absl import flags

from dlm_jax.analysis import clock_steering
from dlm_jax.instrument.hook_call import CaptureValues, hook_values
from dlm_jax.instrument.hook_spec import Capture, Edit, Hooks
from dlm_jax.instrument.step_schedule import CoefficientSchedule, Gate, StepSchedule
from dlm_jax.model import init_params
from dlm_jax.sampling import driver
from dlm_jax.session import checkpoint_bundle, decode_settings
from dlm_jax.session.decode_settings import DecodeSettings
from experiments.common import (analysis_flags, atomic_files, checkpoints, cli, decoding, devices, flag_checks,
                                item_batches, items, model_runs, numerics, numerics_flags, progress, prompts, run_dir,
                                scoring)
from experiments.common.items import TaskSettings
from experiments.common.numerics import Numerics
from experiments.reports import steering_plots, summary_files

_CHECKPOINTS = flags.DEFINE_list("checkpoints", ["tiny-dlm", "tiny-moe-dlm"],
                                 f"Checkpoints ([label=]DIR or {', '.join(checkpoints.NAMES)}); masked diffusion "
                                 "models.")
_N_PROMPTS = flags.DEFINE_integer("n_prompts", 8, "Prompts per model (0 = the whole task).")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 8, "Prompts per sampler call (results do not depend on it).")
_COEFFICIENTS = flags.DEFINE_list("coefficients", ["-2", "-1", "0", "1", "2"],
                                  "Steering coefficients α (must include 0, the baseline).")
_SCHEDULES = flags.DEFINE_list("schedules", ["constant", "first_half", "second_half", "gated"],
                               "constant, first_half, second_half, window:A-B, table:c0/c1/..., gated.")
_LAYER = flags.DEFINE_integer("layer", 2, "The layer whose hook_resid_post is steered (>= 1 with 'gated').")
_SCOPE = flags.DEFINE_enum("scope", "masked", ["masked", "committed", "decoded", "all"],
                           "The positions steered (position class).")
_N_BINS = flags.DEFINE_integer("n_bins", 4, "Step bins of the clock direction (one vector per bin).")
_CLOCK_TARGET = flags.DEFINE_enum("clock_target", "last", ["last", "first"],
                                  "The bin t̂ the clock direction points to.")
_DIRECTION = flags.DEFINE_enum("direction", "clock", ["clock", "random"],
                               "clock, or random: per bin a random direction with the clock vector's norm (a "
                               "control; seeded by --seed).")

NAMED = ("constant", "first_half", "second_half", "gated")


def parse_schedule(text: str) -> tuple[str, CoefficientSchedule | None]:
  """A --schedules entry: (name, its coefficient schedule, or None for the halves, which need the run's
  length); a one-line UserError otherwise."""
  if text in NAMED:
    return text, CoefficientSchedule("constant", 1.0) if text in ("constant", "gated") else None
  kind, _, rest = text.partition(":")
  try:
    if kind == "window":
      start, stop = (int(v) for v in rest.split("-"))
      return text, CoefficientSchedule("window", 1.0, start=start, stop=stop)
    if kind == "table":
      return text, CoefficientSchedule("table", values=tuple(float(v) for v in rest.split("/")))
  except ValueError as error:
    detail = f" ({error})" if "schedule" in str(error) else ""
    raise cli.UserError(f"--schedules={text}: expected window:A-B or table:c0/c1/... with numbers{detail}") from None
  raise cli.UserError(f"--schedules={text}: expected one of {', '.join(NAMED)}, window:A-B or table:c0/c1/...")


def step_table(name: str, schedule: CoefficientSchedule | None, n_steps: int) -> np.ndarray:
  """[n_steps] coefficients of a parsed schedule for a run of n_steps steps (ValueError past the run)."""
  if schedule is None:
    half = n_steps // 2
    schedule = CoefficientSchedule("window", 1.0, *((0, half) if name == "first_half" else (half, n_steps)))
  return schedule.table(n_steps)


@dataclasses.dataclass(frozen=True)
class Settings:
  """Everything that defines a steering_sweep run (recorded in run.json; flags of the same names)."""

  checkpoints: tuple[str, ...]
  n_prompts: int
  batch_size: int
  coefficients: tuple[float, ...]
  schedules: tuple[str, ...]
  layer: int
  scope: str
  n_bins: int
  clock_target: str
  direction: str
  task: TaskSettings
  decode: DecodeSettings
  numerics: Numerics

  def __post_init__(self):
    flag_checks.checkpoints_given(self.checkpoints)
    flag_checks.positive(batch_size=self.batch_size, n_bins=self.n_bins)
    flag_checks.item_count(n_prompts=self.n_prompts)
    if 0.0 not in self.coefficients:
      raise cli.UserError(f"--coefficients={','.join(map(str, self.coefficients))}: expected 0 among them (the "
                          "unsteered baseline)")
    if len(set(self.coefficients)) != len(self.coefficients) or not all(np.isfinite(self.coefficients)):
      raise cli.UserError("--coefficients: expected distinct finite numbers")
    if not self.schedules or len(set(self.schedules)) != len(self.schedules):
      raise cli.UserError("--schedules: expected distinct schedules")
    for text in self.schedules:
      parse_schedule(text)
    if self.layer < 0 or ("gated" in self.schedules and self.layer < 1):
      raise cli.UserError(f"--layer={self.layer}: expected a layer >= 0 (>= 1 with the gated schedule, whose probe "
                          "reads layer --layer − 1)")

  def check_model(self, model: checkpoint_bundle.Model, n_steps: int) -> None:
    """One-line refusals for this model and its run of n_steps steps, before any model work."""
    if model.config.mask_token_id is None or model.config.logit_shift:
      raise cli.UserError(f"{model.label}: steering_sweep reads masked diffusion models (a mask token, no logit "
                          "shift)")
    if self.layer >= model.config.n_layers:
      raise cli.UserError(f"--layer={self.layer}: {model.label} has layers 0..{model.config.n_layers - 1}")
    if self.n_bins > n_steps:
      raise cli.UserError(f"--n_bins={self.n_bins}: {model.label}'s sampler runs {n_steps} steps")
    for text in self.schedules:
      try:
        step_table(*parse_schedule(text), n_steps)
      except ValueError as error:
        raise cli.UserError(f"--schedules={text}: {model.label}: {error}") from None


def sweep_hooks(settings: Settings, n_steps: int, gated: bool) -> Hooks:
  """The sweep's hooks: the final-normed hidden state at every step, and the scheduled clock edit (with the
  clock probe at layer − 1 as its gate when `gated`)."""
  captures = [Capture("ln_final.hook_normalized")]
  gate = None
  if gated:
    captures.append(Capture("hook_resid_post", layers=(settings.layer - 1,), reduce="project", label="clock_probe"))
    gate = Gate(f"clock_probe.{settings.layer - 1}")
  edit = Edit("hook_resid_post", "add", layers=(settings.layer,), positions=settings.scope,
              schedule=StepSchedule(n_steps, settings.n_bins, gate))
  return Hooks(captures=tuple(captures), edits=(edit,))


def calibration_hooks(settings: Settings) -> Hooks:
  layers = tuple(sorted({max(settings.layer - 1, 0), settings.layer}))
  return Hooks(captures=(Capture("hook_resid_post", layers=layers, reduce="mean", positions="masked"),))


def run_steps(model: checkpoint_bundle.Model, values: dict, batch: item_batches.Batch, runtime, numerics) -> int:
  """The most model calls the model's sampler makes on this batch, from its abstract evaluation."""
  def run():
    params = init_params(model.config, jax.random.key(0), numerics.weight_dtype)
    sample = decoding.sampler(dataclasses.replace(model, params=params), values, batch.prompts, runtime, numerics,
                              key=batch.key)
    return sample()
  return int(driver.abstract_trace(run).active_rows.shape[0])


def _prompts(settings: Settings, model: checkpoint_bundle.Model) -> tuple[list, prompts.PromptSet]:
  """The model's items and their encoded prompts."""
  todo = items.load_items(items.task_name(settings.task.task, model.record), settings.n_prompts,
                          settings.task.data_seed)
  return todo, prompts.encode(model, todo)


def _first_batch(settings: Settings, todo, prompt_set, runtime) -> item_batches.Batch:
  return next(item_batches.batches(todo, prompt_set, settings.batch_size, settings.decode.seed, runtime,
                                   lambda item: False))


def calibrate(settings: Settings, model, values, todo, prompt_set, runtime, n_steps: int) -> dict:
  """The clock: per layer the bin means [n_bins, D] and the clock vectors, from unsteered runs."""
  hooks = calibration_hooks(settings)
  bins = clock_steering.step_bins(n_steps, settings.n_bins)
  sums = {}
  for batch in item_batches.batches(todo, prompt_set, settings.batch_size, settings.decode.seed, runtime,
                                    lambda item: False):
    sample = decoding.sampler(model, values, batch.prompts, runtime, settings.numerics, key=batch.key)
    trace = sample(hooks=hooks)
    real = len(batch.items)
    lp = batch.prompts.ids.shape[1]
    masked = clock_steering.masked_at_steps(np.asarray(trace.decode_step)[:real], n_steps, lp)
    counts = masked.sum(-1)  # [n, B]
    for name, mean in trace.captures.items():
      sums.setdefault(name, []).append((np.asarray(mean)[:, :real], counts))
  clock = {}
  for name, parts in sums.items():
    means = np.concatenate([m for m, _ in parts], axis=1)
    counts = np.concatenate([c for _, c in parts], axis=1)
    try:
      bin_means = clock_steering.bin_means(means, counts, bins, settings.n_bins)
    except ValueError as error:
      raise cli.UserError(f"--n_bins={settings.n_bins}: {model.label}: {error}") from None
    target = settings.n_bins - 1 if settings.clock_target == "last" else 0
    clock[name] = {"bin_means": bin_means, "vectors": clock_steering.clock_vectors(bin_means, target)}
  return {"bins": bins, **clock}


def gate_values(clock: dict, layer: int) -> tuple[np.ndarray, float, float]:
  """The clock probe at layer `layer` (module docstring): (unit direction [1, D], scale, bias)."""
  means = clock[f"blocks.{layer}.hook_resid_post"]["bin_means"]
  delta = means[-1] - means[0]
  unit = delta / np.linalg.norm(delta)
  span = float(unit @ delta)
  middle = float(unit @ (means[0] + means[-1]) / 2)
  scale = -4.0 / span
  return unit[None].astype(np.float32), scale, -scale * middle


def steering_vectors(settings: Settings, clock_vectors: np.ndarray) -> np.ndarray:
  """[n_bins, D]: the clock vectors, or (--direction=random) per bin a Gaussian direction of the same norm."""
  if settings.direction == "clock":
    return clock_vectors
  random = np.random.default_rng(settings.decode.seed).normal(size=clock_vectors.shape)
  norms = np.linalg.norm(clock_vectors, axis=-1, keepdims=True) / np.linalg.norm(random, axis=-1, keepdims=True)
  return (random * norms).astype(np.float32)


def run_model(settings: Settings, model, runtime: devices.Runtime, log: run_dir.ResultsLog) -> dict:
  """Calibrates the clock, then decodes every (schedule, coefficient) not done yet; returns the model's meta."""
  values = decode_settings.model_settings(settings.decode, model)
  todo, prompt_set = _prompts(settings, model)
  n_steps = run_steps(model, values, _first_batch(settings, todo, prompt_set, runtime), runtime, settings.numerics)
  clock = calibrate(settings, model, values, todo, prompt_set, runtime, n_steps)
  vectors = steering_vectors(settings, clock[f"blocks.{settings.layer}.hook_resid_post"]["vectors"])
  conditions = [(s, c) for s in settings.schedules for c in settings.coefficients]
  done = lambda item, s, c: log.done(model=model.label, schedule=s, coefficient=c, item=item.id)  # noqa: E731
  meter = progress.Progress(f"{model.label} (schedule, coefficient, prompt)", len(conditions) * len(todo),
                            sum(done(i, s, c) for s, c in conditions for i in todo))
  for schedule, coefficient in conditions:
    gated = schedule == "gated"
    hooks = sweep_hooks(settings, n_steps, gated)
    table = step_table(*parse_schedule(schedule), n_steps)
    for batch in item_batches.batches(todo, prompt_set, settings.batch_size, settings.decode.seed, runtime,
                                      lambda item: done(item, schedule, coefficient)):
      rows, lp = batch.prompts.ids.shape
      edit = dict(vector=vectors, coefficient=coefficient, schedule=dict(table=table, bins=clock["bins"]))
      captures = {}
      if gated:
        direction, scale, bias = gate_values(clock, settings.layer - 1)
        edit["schedule"].update(gate_scale=scale, gate_bias=bias)
        captures = {1: CaptureValues(directions=direction)}
      sample = decoding.sampler(model, values, batch.prompts, runtime, settings.numerics, key=batch.key)
      trace = sample(hooks=hooks, hook_values=hook_values(hooks, model.config, rows, lp + values["gen_length"],
                                                          captures=captures, edits={0: edit}))
      decoding.check_finite(trace, [f"{model.label} batch row {r}" for r in range(rows)])
      masked = clock_steering.masked_at_steps(np.asarray(trace.decode_step), n_steps, lp)
      confidence, entropy, count = clock_steering.step_confidence_entropy(
          model.params, model.config, np.asarray(trace.captures["ln_final.hook_normalized"]), masked)
      generated = np.asarray(trace.generated)
      for row, item in enumerate(batch.items):
        if done(item, schedule, coefficient):
          continue
        _, text = prompts.completion(model, generated[row])
        record = {"model": model.label, "schedule": schedule, "coefficient": coefficient, "item": item.id,
                  "masked_read": count[:, row], "confidence": confidence[:, row].round(6),
                  "entropy": entropy[:, row].round(6), "tokens": generated[row], "completion": text,
                  "correct": scoring.score(item, text, model.prompt_format == "chat")["correct"]}
        meter.update(int(log.append(record)))
  return {"label": model.label, "sampler": model.sampler, "steps": n_steps, "settings": values,
          "table": {s: step_table(*parse_schedule(s), n_steps) for s in settings.schedules},
          "token_text": [model.tokenizer.id_to_token(i) for i in range(model.config.vocab_size)], "clock": clock}


def aggregate(records: list[dict], meta: dict, settings: Settings) -> dict:
  """Per schedule and coefficient: per step the mean confidence and entropy over every masked position read
  (pooled over prompts), their change against coefficient 0, the accuracy and the share of answer tokens that
  differ from the baseline's."""
  out = {}
  base = {r["item"]: np.asarray(r["tokens"]) for r in records if r["coefficient"] == 0.0
          and r["schedule"] == settings.schedules[0]}
  for schedule in settings.schedules:
    rows = {c: [r for r in records if r["schedule"] == schedule and r["coefficient"] == c]
            for c in settings.coefficients}
    per = {}
    for c, group in rows.items():
      if not group:
        continue
      count = np.sum([r["masked_read"] for r in group], axis=0).astype(np.float64)
      with np.errstate(invalid="ignore", divide="ignore"):
        conf = np.sum([np.asarray(r["confidence"]) * r["masked_read"] for r in group], axis=0) / count
        ent = np.sum([np.asarray(r["entropy"]) * r["masked_read"] for r in group], axis=0) / count
      changed = [np.mean(np.asarray(r["tokens"]) != base[r["item"]]) for r in group if r["item"] in base]
      per[c] = {"confidence": conf, "entropy": ent, "masked_read": count.astype(int),
                "mean_confidence": float(np.nansum(conf * count) / count.sum()),
                "mean_entropy": float(np.nansum(ent * count) / count.sum()),
                "accuracy": float(np.mean([r["correct"] for r in group])),
                "tokens_changed": float(np.mean(changed)) if changed else float("nan"), "prompts": len(group)}
    if 0.0 in per:
      for c in per:
        per[c]["delta_confidence"] = per[c]["mean_confidence"] - per[0.0]["mean_confidence"]
        per[c]["delta_entropy"] = per[c]["mean_entropy"] - per[0.0]["mean_entropy"]
    out[schedule] = per
  return out


def write_report(settings: Settings, out: str, metas: list[dict], records: list[dict], wall_s: float) -> str:
  lines = ["# Steering along the denoising clock: `experiments.steering_sweep`", "",
           f"hook_resid_post of layer {settings.layer}, positions {settings.scope}, "
           + ("clock direction μ[t̂] − μ[bin t]" if settings.direction == "clock" else
              "random directions with the norms of the clock vectors μ[t̂] − μ[bin t] (a control)")
           + f" with {settings.n_bins} step bins and t̂ the {settings.clock_target} bin; calibrated on the same "
           f"prompts. Wall time {wall_s:.0f}s.", "",
           "Mean over every (step, masked position) read: confidence (largest probability) and entropy (nats), "
           "their change against coefficient 0, accuracy, and the share of answer tokens that differ from the "
           "unsteered answer:", "",
           "| model | schedule | α | confidence | Δ | entropy | Δ | accuracy | tokens changed |",
           "|---|---|---|---|---|---|---|---|---|"]
  summary, links = {}, [""]
  for meta in metas:
    rows = [r for r in records if r["model"] == meta["label"]]
    if not rows:
      continue
    pooled = aggregate(rows, meta, settings)
    summary[meta["label"]] = {"steps": meta["steps"], "tables": meta["table"], "per_schedule": {
        s: {str(c): v for c, v in per.items()} for s, per in pooled.items()}}
    for schedule, per in pooled.items():
      for c, v in per.items():
        lines.append(f"| {meta['label']} | {schedule} | {c:g} | {v['mean_confidence']:.4f} | "
                     f"{v.get('delta_confidence', float('nan')):+.4f} | {v['mean_entropy']:.4f} | "
                     f"{v.get('delta_entropy', float('nan')):+.4f} | {v['accuracy']:.2f} | {v['tokens_changed']:.2f} |")
    model_dir = os.path.join(out, meta["label"])
    os.makedirs(model_dir, exist_ok=True)
    atomic_files.write_npz(os.path.join(model_dir, "clock.npz"), bins=meta["clock"]["bins"],
                           **{f"{k}:{name}": v for k, entry in meta["clock"].items() if k != "bins"
                              for name, v in entry.items()})
    for key, label in (("confidence", "mean confidence (largest probability)"), ("entropy", "mean entropy (nats)")):
      figure = steering_plots.per_step_panels(
          {s: {f"α={c:g}": per[c][key] for c in sorted(per)} for s, per in pooled.items()},
          f"{meta['label']}: {label} at the still-masked positions per step, steering layer {settings.layer} along "
          f"the {'clock' if settings.direction == 'clock' else 'random control'} ({settings.scope} positions)", label,
          steering_plots.ordered_colours([f"α={c:g}" for c in sorted(settings.coefficients)], "α=0"))
      atomic_files.save_figure(figure, os.path.join(model_dir, f"{key}_per_step.png"))
    first = settings.schedules[0]
    example = {c: r for r in rows for c in settings.coefficients
               if r["schedule"] == first and r["coefficient"] == c and r["item"] == rows[0]["item"]}
    tokens = {f"α={c:g}": [meta["token_text"][t] for t in example[c]["tokens"]] for c in settings.coefficients
              if c in example}
    atomic_files.save_figure(steering_plots.answer_tokens(
        tokens, "α=0", f"{meta['label']}, prompt {rows[0]['item']}, schedule {first}: the answer per coefficient "
        "(tokens that differ from α=0 highlighted)"), os.path.join(model_dir, "example_answers.png"))
    links.append(f"- [{meta['label']}/confidence_per_step.png]({meta['label']}/confidence_per_step.png), "
                 f"[{meta['label']}/entropy_per_step.png]({meta['label']}/entropy_per_step.png), "
                 f"[{meta['label']}/example_answers.png]({meta['label']}/example_answers.png)")
  lines += links
  return summary_files.write(out, {"models": [{k: v for k, v in m.items() if k not in ("token_text", "clock")}
                                              for m in metas],
                                   "summary": summary, "wall_s": wall_s}, lines)


def main(argv):
  del argv
  shared = analysis_flags.from_flags("steering_sweep", _CHECKPOINTS)
  models = shared.prepare_models()
  runtime = devices.init_runtime(shared.runtime)
  try:
    coefficients = tuple(float(c) for c in _COEFFICIENTS.value)
  except ValueError:
    raise cli.UserError(f"--coefficients={','.join(_COEFFICIENTS.value)}: expected numbers") from None
  settings = Settings(checkpoints=shared.checkpoints, n_prompts=_N_PROMPTS.value, batch_size=_BATCH_SIZE.value,
                      coefficients=coefficients, schedules=tuple(_SCHEDULES.value), layer=_LAYER.value,
                      scope=_SCOPE.value, n_bins=_N_BINS.value, clock_target=_CLOCK_TARGET.value,
                      direction=_DIRECTION.value, task=shared.task,
                      decode=shared.decode, numerics=numerics_flags.from_flags(shared.runtime))
  for model in models:
    values = decode_settings.model_settings(shared.decode, model)
    todo, prompt_set = _prompts(settings, model)
    settings.check_model(model, run_steps(model, values, _first_batch(settings, todo, prompt_set, runtime), runtime,
                                          settings.numerics))
  runs = model_runs.run_models(shared.output, settings, models, runtime, shared.task.task, run_model,
                               keys=("model", "schedule", "coefficient", "item"))
  if runs is not None:
    progress.summary_banner(runs.out.path, write_report(settings, runs.out.path, runs.metas, runs.log.records,
                                                        runs.seconds))


if __name__ == "__main__":
  cli.run(main)
