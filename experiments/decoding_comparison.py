r"""Sinks and sink masking under each decoding mode against exact decoding, from finished runs' JSON.

  python -m experiments.decoding_comparison --runs=RUN_EXACT,RUN_THRESHOLD,... --output_dir=OUT

Each run directory holds `sink_analysis/` (an `experiments.sink_analysis` run: run.json, summary.json,
results.jsonl) and/or `sink_masking_eval/` (an `experiments.sink_masking_eval` run: run.json, table.json),
both decoded in one --decoding mode; a run is named by the mode its run.json records. The first run is
the reference (exact decoding). For the DLM --model (default: the first diffusion model of the reference)
it writes to --output_dir:

  comparison.json   every number of the tables below, per mode
  comparison.md     sinks (accuracy, NFE per row, ε-rule counts, sink positions, moving-sink rates, sink
                    tokens) and masking degradation (accuracy with the top-K sinks of the previous step
                    masked, and its change from K = 0), each against the reference
  decoding_modes.png  masking accuracy against K, and per layer: largest-sink change rate, sinks per head,
                    agreement of the modal sink position with the reference

Sink positions: for each item and recorded layer, the modal largest sink (the position most often the
largest sink over the item's decoded steps and the heads); "same modal sink" is the fraction of (item,
layer) pairs where a mode's equals the reference's, over all decoded steps and over the whole-sequence steps
only (every step without a cache, a block's refresh step with one). "lifetime / NFE" is the mean sink
lifetime as a fraction of the item's steps (the modes take different numbers of steps). No model is run;
nothing is written before every input has been read.
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings

import numpy as np
from absl import flags

from dlm_jax.io import json_files
from dlm_jax.session.decoding_mode import MODES, DecodingMode
from experiments.common import atomic_files, cli, progress, results_file, run_dir
from experiments.reports import plots

_RUNS = flags.DEFINE_list("runs", None, "Run directories (each with sink_analysis/ and/or sink_masking_eval/); the "
                          "first is the reference.", required=True)
_MODEL = flags.DEFINE_string("model", None, "Model label to compare (default: the reference's first DLM).")
_OUTPUT_DIR = flags.DEFINE_string("output_dir", "results/decoding_comparison", "Where the comparison goes.")

SINK_KEYS = ("sinks_per_head", "steps_with_sink", "change_rate", "drift", "mean_lifetime")


@dataclasses.dataclass(frozen=True)
class Settings:
  """runs: the run directories (the first is the reference); model: the label compared (None = default);
  output_dir: where the comparison goes."""

  runs: tuple[str, ...]
  model: str | None
  output_dir: str

  def __post_init__(self):
    if len(self.runs) < 2:
      raise cli.UsageError(f"--runs={','.join(self.runs)}: expected at least two run directories (the first is "
                           "the reference)")
    for path in self.runs:
      if not os.path.isdir(path):
        raise cli.UserError(f"--runs: {path} is not a directory")
      if not any(os.path.isdir(os.path.join(path, part)) for part in ("sink_analysis", "sink_masking_eval")):
        raise cli.UserError(f"--runs: {path} holds neither sink_analysis/ nor sink_masking_eval/")


def _read_json(path: str):
  if not os.path.isfile(path):
    raise cli.UserError(f"{path} is missing; finish that run first")
  return json_files.read_json(path, cli.UserError)


def _read_jsonl(path: str) -> list[dict]:
  if not os.path.isfile(path):
    raise cli.UserError(f"{path} is missing; finish that run first")
  return results_file.read(path, ("model",)).records


def _mode(part_dir: str) -> DecodingMode:
  settings = _read_json(os.path.join(part_dir, run_dir.RUN_FILE)).get("settings", {})
  return DecodingMode(**settings.get("decoding", {}))


def _mean(values) -> float:
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", RuntimeWarning)
    return float(np.nanmean(np.asarray(values, np.float64)))


def _sinks(part_dir: str, model: str) -> dict:
  """The sink_analysis numbers of `model` in one run."""
  summary = _read_json(os.path.join(part_dir, "summary.json"))
  agg = summary["aggregates"].get(model)
  if agg is None:
    raise cli.UserError(f"{part_dir}: no results for model {model} (it has {', '.join(summary['aggregates'])})")
  records = [r for r in _read_jsonl(os.path.join(part_dir, "results.jsonl")) if r["model"] == model]
  meta = next(m for m in summary["models"] if m["label"] == model)
  moving = agg["moving_per_layer"]
  return {"n_items": agg["n_items"], "accuracy": agg["accuracy"], "mean_nfe": agg["mean_nfe"],
          "sink_fraction": agg["sink_fraction"], "nonsink_fraction_at_epsilon": agg["nonsink_fraction_at_epsilon"],
          "largest_in_prompt": agg["largest_in_prompt"], "largest_at_first_token": agg["largest_at_first_token"],
          "sink_tokens": agg["sink_tokens"][:3], "layers": meta["layers"],
          "per_layer": {k: moving[k] for k in SINK_KEYS},
          "mean": {k: _mean(moving[k]) for k in SINK_KEYS},
          "separate_sinks": _mean(agg["separate_sinks_per_layer"]) if "separate_sinks_per_layer" in agg else None,
          "lifetime_fraction": _mean([np.asarray(r["moving"]["mean_lifetime"], np.float64) / r["nfe"]
                                      for r in records]),
          "whole_canvas_fraction": float(np.sum([r["whole_canvas_steps"] for r in records])
                                         / max(np.sum([r["nfe"] for r in records]), 1)),
          "modal_largest_sink": {r["item"]: r["modal_largest_sink"] for r in records},
          "modal_largest_sink_whole_canvas": {r["item"]: r["modal_largest_sink_whole_canvas"] for r in records}}


def _masking(part_dir: str, model: str) -> dict:
  """The sink_masking_eval numbers of `model` in one run: per K, accuracy, its standard error, mean NFE."""
  table = _read_json(os.path.join(part_dir, "table.json"))
  cells = table["accuracy"].get(model)
  if cells is None:
    raise cli.UserError(f"{part_dir}: no results for model {model}")
  ks = [int(k) for k in table["top_k"]]
  return {"top_k": ks, "n": cells[str(ks[0])]["n"], "accuracy": [cells[str(k)]["accuracy"] for k in ks],
          "se": [cells[str(k)]["se"] for k in ks], "mean_nfe": [cells[str(k)].get("mean_nfe") for k in ks]}


def _agreement(mode: dict, reference: dict) -> tuple[float, list[float]]:
  """(overall, per layer) fraction of (item, layer) pairs whose modal largest sink equals the reference's."""
  items = sorted(set(mode) & set(reference))
  if not items:
    return float("nan"), []
  same = np.asarray([[a == b for a, b in zip(mode[i], reference[i])] for i in items], np.float64)
  return float(same.mean()), same.mean(0).tolist()


def _default_model(part_dir: str) -> str:
  summary = _read_json(os.path.join(part_dir, "summary.json"))
  labels = [m["label"] for m in summary["models"] if m["diffusion"]]
  if not labels:
    raise cli.UserError(f"{part_dir}: no diffusion model to compare; pass --model")
  return labels[0]


def collect(settings: Settings) -> dict:
  """Every mode's numbers (the reference first), with the sink-position agreement against the reference."""
  first_sinks = os.path.join(settings.runs[0], "sink_analysis")
  model = settings.model or (_default_model(first_sinks) if os.path.isdir(first_sinks) else None)
  if model is None:
    raise cli.UsageError("pass --model: the reference run has no sink_analysis/ to take the default from")
  modes = []
  for path in settings.runs:
    entry = {"run": progress.display_path(os.path.abspath(path))}
    for part, read in (("sink_analysis", _sinks), ("sink_masking_eval", _masking)):
      part_dir = os.path.join(path, part)
      if os.path.isdir(part_dir):
        entry["mode"] = _mode(part_dir).spec
        entry["sinks" if part == "sink_analysis" else "masking"] = read(part_dir, model)
    modes.append(entry)
  labels = [m["mode"] for m in modes]
  if len(set(labels)) != len(labels):
    raise cli.UserError(f"--runs: two runs have the same decoding mode ({', '.join(labels)})")
  reference = modes[0].get("sinks")
  for entry in modes:
    if reference is not None and "sinks" in entry:
      overall, per_layer = _agreement(entry["sinks"]["modal_largest_sink"], reference["modal_largest_sink"])
      entry["sinks"]["same_modal_sink"], entry["sinks"]["same_modal_sink_per_layer"] = overall, per_layer
      entry["sinks"]["same_modal_sink_whole_canvas"] = _agreement(
          entry["sinks"]["modal_largest_sink_whole_canvas"], reference["modal_largest_sink_whole_canvas"])[0]
  return {"model": model, "reference": labels[0], "modes": modes}


def _fmt(value, digits: int = 3, reference=None, signed_digits: int | None = None) -> str:
  if value is None or (isinstance(value, float) and not math.isfinite(value)):
    return "–"
  text = f"{value:.{digits}f}"
  if reference is not None and isinstance(reference, (int, float)) and math.isfinite(reference):
    text += f" ({value - reference:+.{digits if signed_digits is None else signed_digits}f})"
  return text


def _sinks_markdown(result: dict) -> list[str]:
  rows = [m for m in result["modes"] if "sinks" in m]
  if not rows:
    return []
  ref = rows[0]["sinks"]
  lines = ["## Sinks across the decoded steps (experiments.sink_analysis)", "",
           f"{result['model']}, {ref['n_items']} prompts per mode; in parentheses the change from "
           f"{rows[0]['mode']}. Per-layer values are averaged over the recorded layers.", "",
           "| mode | accuracy | NFE per row | whole-sequence steps | sink fraction (ε-rule) | non-sinks at ε | "
           "sinks per head and step | steps with a sink | largest sink moved (change rate) | drift | "
           "sink lifetime (steps) | lifetime / NFE | largest sink in prompt | largest sink = first token | "
           "same modal sink as reference | same, whole-sequence steps | masked/unmasked separate | top sink tokens |",
           "|---|" + "---|" * 17]
  for m in rows:
    s = m["sinks"]
    base = None if m is rows[0] else ref
    pick = (lambda key: None) if base is None else (lambda key: base[key])
    mean = (lambda key: None) if base is None else (lambda key: base["mean"][key])
    tokens = ", ".join(f"`{t}` {f:.2f}" for t, f in s["sink_tokens"])
    lines.append(
        f"| {m['mode']} | {_fmt(s['accuracy'], 2, pick('accuracy'))} | {_fmt(s['mean_nfe'], 1, pick('mean_nfe'))} | "
        f"{_fmt(s['whole_canvas_fraction'], 2)} | {_fmt(s['sink_fraction'], 4, pick('sink_fraction'))} | "
        f"{_fmt(s['nonsink_fraction_at_epsilon'], 4, pick('nonsink_fraction_at_epsilon'))} | "
        + " | ".join(_fmt(s["mean"][k], 2, mean(k)) for k in SINK_KEYS) + " | "
        f"{_fmt(s['lifetime_fraction'], 2, pick('lifetime_fraction'))} | "
        f"{_fmt(s['largest_in_prompt'], 2, pick('largest_in_prompt'))} | "
        f"{_fmt(s['largest_at_first_token'], 2, pick('largest_at_first_token'))} | "
        f"{_fmt(s.get('same_modal_sink'), 2)} | {_fmt(s.get('same_modal_sink_whole_canvas'), 2)} | "
        f"{_fmt(s['separate_sinks'], 2, pick('separate_sinks'))} | {tokens} |")
  return lines


def _masking_markdown(result: dict) -> list[str]:
  rows = [m for m in result["modes"] if "masking" in m]
  if not rows:
    return []
  ks = rows[0]["masking"]["top_k"]
  names = ["none" if k == 0 else f"top-{k}" for k in ks]
  lines = ["## Accuracy with the previous step's top-K sinks masked (experiments.sink_masking_eval)", "",
           f"{result['model']}, {rows[0]['masking']['n']} items per mode and K; accuracy ± binomial standard error, "
           "then the change from K = 0 (the degradation) and the mean NFE per item.", "",
           "| mode | " + " | ".join(f"{n} masked" for n in names) + " | " +
           " | ".join(f"Δ {n}" for n in names[1:]) + " | NFE (K = 0) | NFE (largest K) |",
           "|---|" + "---|" * (2 * len(ks) + 1)]
  for m in rows:
    c = m["masking"]
    acc = [f"{a:.2f} ± {e:.2f}" for a, e in zip(c["accuracy"], c["se"])]
    drops = [f"{a - c['accuracy'][0]:+.2f}" for a in c["accuracy"][1:]]
    lines.append(f"| {m['mode']} | " + " | ".join(acc + drops) + f" | {_fmt(c['mean_nfe'][0], 1)} | "
                 f"{_fmt(c['mean_nfe'][-1], 1)} |")
  return lines


def markdown(result: dict) -> str:
  """comparison.md."""
  lines = [f"# Decoding modes against {result['reference']} decoding: sinks and sink masking", "",
           "Produced by `python -m experiments.decoding_comparison` from the runs listed at the end. Modes: "
           + "; ".join(f"`{name}` = {rule} rule, {cache} cache" for name, (rule, cache) in MODES.items()) + ".",
           "", "Under a KV cache a step's statistics are the incoming attention of the queries the step computed "
           "(the whole sequence at a block's refresh step; then the block and every later position with the prefix "
           "cache, the block alone with the dual cache) over all keys, cached keys included; scores stay relative "
           "to the uniform share of those queries, so the ε-rule means the same thing in every mode. Every "
           "measure reads only the steps a generation decoded at.", ""]
  lines += _sinks_markdown(result) + [""] + _masking_markdown(result)
  lines += ["", "![decoding modes](decoding_modes.png)", "", "Runs:", ""]
  lines += [f"- {m['mode']}: `{m['run']}`" for m in result["modes"]]
  return "\n".join(lines) + "\n"


def figure(result: dict):
  """The four panels of decoding_modes.png."""
  masking = {m["mode"]: (np.asarray(m["masking"]["accuracy"]), np.asarray(m["masking"]["se"]))
             for m in result["modes"] if "masking" in m}
  ks = next((m["masking"]["top_k"] for m in result["modes"] if "masking" in m), [])
  sinks = {m["mode"]: m["sinks"] for m in result["modes"] if "sinks" in m}
  layers = next(iter(sinks.values()))["layers"] if sinks else []
  per_layer = {
      "largest sink moved between steps (change rate)": {k: np.asarray(s["per_layer"]["change_rate"], float)
                                                         for k, s in sinks.items()},
      "sinks per head and step": {k: np.asarray(s["per_layer"]["sinks_per_head"], float) for k, s in sinks.items()},
      f"same modal sink as {result['reference']}": {k: np.asarray(s.get("same_modal_sink_per_layer", []), float)
                                                    for k, s in sinks.items()},
  }
  return plots.decoding_mode_panels(ks, masking, layers, per_layer,
                                    f"{result['model']}: decoding modes against {result['reference']}")


def main(argv):
  del argv
  if not _OUTPUT_DIR.value.strip():  # an empty one would be the working directory itself
    raise cli.UsageError(f"--output_dir={_OUTPUT_DIR.value!r} is blank; expected a path")
  settings = Settings(runs=tuple(_RUNS.value), model=_MODEL.value, output_dir=os.path.abspath(_OUTPUT_DIR.value))
  run_dir.check_output_file(os.path.join(settings.output_dir, "comparison.json"), "output_dir")
  result = collect(settings)
  os.makedirs(settings.output_dir, exist_ok=True)
  atomic_files.write_json(os.path.join(settings.output_dir, "comparison.json"), result)
  text = markdown(result)
  atomic_files.write_text(os.path.join(settings.output_dir, "comparison.md"), text)
  atomic_files.save_figure(figure(result), os.path.join(settings.output_dir, "decoding_modes.png"))
  print(text)


if __name__ == "__main__":
  cli.run(main)
