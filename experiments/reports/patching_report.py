"""The report of experiments.activation_patching: per model, normalized patching effects (clean = 1, corrupted =
0; `dlm_jax.analysis.patching.PatchingResult`) as layer × step and layer × head heatmaps, their means and
standard errors over pairs in summary.json, and attribution patching against the immediate effect of real
patching (Pearson r and sign agreement)."""

from __future__ import annotations

import os

import numpy as np

from dlm_jax.analysis.patching import PatchingResult
from experiments.common import atomic_files
from experiments.reports import plots  # noqa: F401  (selects the Agg backend before pyplot is imported)
from experiments.reports import summary_files

import matplotlib.pyplot as plt  # noqa: E402  pylint: disable=wrong-import-order

DIVERGING = "RdBu_r"
"""Colour map of normalized effects (0 = the corrupted run, white; 1 = the clean run, red)."""


def site_result(rows: list[dict], site: str, key: str = "grids") -> PatchingResult:
  """PatchingResult of one site over a model's records: effects [cells, E] (cells of the [.., ..] grid in
  row-major order)."""
  effects = np.stack([np.asarray(r[key][site], np.float64).reshape(-1) for r in rows], axis=1)
  return PatchingResult(effects=effects, clean=np.asarray([r["clean_metric"] for r in rows]),
                        corrupted=np.asarray([r["corrupted_metric"] for r in rows]))


def correlation(rows: list[dict], site: str) -> dict:
  """Attribution vs the immediate effect of real patching over every (pair, layer, step) cell: Pearson r,
  and the fraction of cells with |immediate| above 1% of the pair's |clean − corrupted| gap whose signs agree."""
  attributed = np.concatenate([np.asarray(r["attribution"][site]).reshape(-1) for r in rows])
  immediate = np.concatenate([np.asarray(r["immediate"][site]).reshape(-1) for r in rows])
  gap = np.concatenate([np.full(np.size(r["immediate"][site]), abs(r["clean_metric"] - r["corrupted_metric"]))
                        for r in rows])
  big = np.abs(immediate) > 0.01 * gap
  r = float(np.corrcoef(attributed, immediate)[0, 1]) if np.std(attributed) > 0 and np.std(immediate) > 0 else None
  return {"pearson_r": r, "sign_agreement": float(np.mean(np.sign(attributed[big]) == np.sign(immediate[big])))
          if big.any() else None, "cells": int(attributed.size), "cells_compared_for_sign": int(big.sum()),
          "max_metric_gap": max(r_.get("attribution_metric_gap", 0.0) for r_ in rows)}


def _example(rows: list[dict]) -> str:
  r = rows[0]
  return (f"example pair (item {r['item']}): \"{r['clean_question']}\"; corrupted: number {r['operand'] + 1} of the "
          f"question {r['old']} → {r['new']}; answer token '{r['clean_token']}' vs '{r['corrupted_token']}' at "
          f"generated position {r['answer_index']}")


def heatmap(grid: np.ndarray, title: str, caption: str, xlabel: str, xticks: list[str], ylabel: str = "layer",
            marker: float | None = None) -> plt.Figure:
  """[Y, X] normalized effects as a heatmap, 0 white, with a caption under the axes (and a dashed line at x =
  marker: the mean step at which the corrupted run decoded the answer)."""
  grid = np.asarray(grid, np.float64)
  fig, ax = plt.subplots(figsize=(max(5.0, 0.28 * grid.shape[1] + 3.0), max(3.2, 0.35 * grid.shape[0] + 2.2)))
  bound = max(1.0, float(np.nanmax(np.abs(grid))) if np.isfinite(grid).any() else 1.0)
  image = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap=DIVERGING, vmin=-bound, vmax=bound)
  step = max(1, grid.shape[1] // 16)
  ax.set_xticks(range(0, grid.shape[1], step), [xticks[i] for i in range(0, grid.shape[1], step)])
  ax.set_yticks(range(grid.shape[0]))
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  if marker is not None:
    ax.axvline(marker, color="black", linestyle="--", linewidth=1, label="answer decoded (corrupted run, mean)")
    ax.legend(loc="upper left", bbox_to_anchor=(0.0, -0.25), fontsize=7, frameon=False)
  ax.set_title(title, fontsize=9)
  fig.colorbar(image, ax=ax, label="normalized effect (clean 1, corrupted 0)")
  fig.text(0.01, 0.01, caption, fontsize=6, wrap=True)
  fig.tight_layout(rect=(0, 0.08, 1, 1))
  return fig


def scatter(rows: list[dict], sites: list[str], title: str) -> plt.Figure:
  """Attribution (x) vs the immediate effect of real patching (y), one point per (pair, layer, step)."""
  fig, ax = plt.subplots(figsize=(5.0, 4.5))
  for site in sites:
    x = np.concatenate([np.asarray(r["attribution"][site]).reshape(-1) for r in rows])
    y = np.concatenate([np.asarray(r["immediate"][site]).reshape(-1) for r in rows])
    ax.scatter(x, y, s=6, alpha=0.6, label=site)
  lims = ax.get_xlim()
  ax.plot(lims, lims, color="black", linewidth=0.8, label="y = x")
  ax.set_xlabel("attribution patching (gradient × Δactivation)")
  ax.set_ylabel("real patching, immediate Δ logit difference")
  ax.set_title(title, fontsize=9)
  ax.legend(fontsize=7)
  fig.tight_layout()
  return fig


def _peak(mean: np.ndarray, steps: list[int]) -> dict:
  layer, column = np.unravel_index(int(np.nanargmax(mean)), mean.shape)
  return {"layer": int(layer), "step": int(steps[column]), "mean_normalized": float(mean[layer, column])}


def model_summary(out: str, meta: dict, rows: list[dict]) -> tuple[dict, list[str]]:
  """(summary.json entry, summary.md lines) of one model; writes its figures under out/<label>/."""
  label, steps = meta["label"], meta["patch_steps"]
  n_layers = meta["n_layers"]
  decode_steps = np.asarray([r["answer_decode_step"] for r in rows], np.float64)
  summary = {"pairs": len(rows), "skipped": meta["skipped"],
             "clean_correct": int(sum(r["clean_correct"] for r in rows)),
             "corrupted_correct": int(sum(r["corrupted_correct"] for r in rows)),
             "clean_metric_mean": float(np.mean([r["clean_metric"] for r in rows])),
             "corrupted_metric_mean": float(np.mean([r["corrupted_metric"] for r in rows])),
             "answer_decode_step_mean": {"clean": float(decode_steps[:, 0].mean()),
                                         "corrupted": float(decode_steps[:, 1].mean())},
             "n_steps": meta["n_steps"], "patch_steps": steps, "sites": {}, "heads": {}, "attribution": {}}
  lines = [f"## {label} ({meta['sampler']}, {len(rows)} pairs, {meta['n_steps']} steps)", "",
           f"Clean / corrupted runs give the reference answer token in {summary['clean_correct']} / "
           f"{summary['corrupted_correct']} pairs; mean logit difference clean {summary['clean_metric_mean']:.2f}, "
           f"corrupted {summary['corrupted_metric_mean']:.2f}; the answer position is decoded at step "
           f"{decode_steps[:, 0].mean():.1f} (clean) / {decode_steps[:, 1].mean():.1f} (corrupted) on average.", ""]
  model_dir = os.path.join(out, label)
  marker = None
  if steps[0] <= decode_steps[:, 1].mean() <= steps[-1]:
    marker = float(np.interp(decode_steps[:, 1].mean(), steps, np.arange(len(steps))))
  for site in meta["grid_sites"]:
    result = site_result(rows, site)
    mean, err = result.mean().reshape(n_layers, len(steps)), result.stderr().reshape(n_layers, len(steps))
    peak = _peak(mean, steps)
    summary["sites"][site] = {"mean_normalized": mean, "stderr_normalized": err, "peak": peak}
    lines.append(f"- {site}: peak normalized effect {peak['mean_normalized']:.2f} ± "
                 f"{err[peak['layer'], steps.index(peak['step'])]:.2f} at layer {peak['layer']}, step {peak['step']}")
    figure = heatmap(mean, f"{label}: patching {site} (clean → corrupted), mean over {len(rows)} pairs",
                     _example(rows), "step of the patch", [str(s) for s in steps], marker=marker)
    atomic_files.save_figure(figure, os.path.join(model_dir, f"{site}.png"))
  for site in meta["head_sites"]:
    result = site_result(rows, site, "heads")
    windows = meta["head_windows"]
    mean = result.mean().reshape(len(windows), n_layers, -1)
    err = result.stderr().reshape(len(windows), n_layers, -1)
    summary["heads"][site] = {"windows": windows, "mean_normalized": mean, "stderr_normalized": err}
    for w, window in enumerate(windows):
      layer, head = np.unravel_index(int(np.nanargmax(mean[w])), mean[w].shape)
      lines.append(f"- {site}, steps {window[0]}–{window[1] - 1}: top head L{layer}H{head} "
                   f"{mean[w][layer, head]:.2f} ± {err[w][layer, head]:.2f}")
    panel = mean.transpose(1, 0, 2).reshape(n_layers, -1)
    ticks = [f"{h}" if len(windows) == 1 else f"{a}:{h}" for a, _ in windows for h in range(mean.shape[2])]
    figure = heatmap(panel, f"{label}: patching each head's {site} over its step window(s)", _example(rows),
                     "head" if len(windows) == 1 else "window start : head", ticks)
    atomic_files.save_figure(figure, os.path.join(model_dir, "heads.png"))
  if meta["attribution"]:
    for site in meta["grid_sites"]:
      summary["attribution"][site] = correlation(rows, site)
      c = summary["attribution"][site]
      lines.append(f"- attribution vs immediate patching, {site}: Pearson r = {c['pearson_r']:.3f}, sign agreement "
                   f"{c['sign_agreement']:.2f} over {c['cells_compared_for_sign']} of {c['cells']} cells")
    atomic_files.save_figure(scatter(rows, meta["grid_sites"], f"{label}: attribution vs real patching (same step)"),
                             os.path.join(model_dir, "attribution.png"))
  return summary, lines + [""]


def write(out: str, metas: list[dict], records: list[dict], wall_s: float) -> str:
  """Writes the figures, summary.json and summary.md; returns the markdown."""
  lines = ["# Activation patching across denoising steps: `experiments.activation_patching`", "",
           "Metric: logit[clean answer] − logit[corrupted answer] at the answer position, read at the step that "
           "decodes it. Normalized effect: (patched − corrupted) / (clean − corrupted), mean ± standard error over "
           f"pairs. Wall time {wall_s:.0f}s.", ""]
  summary = {}
  for meta in metas:
    rows = [r for r in records if r["model"] == meta["label"]]
    if rows:
      summary[meta["label"]], model_lines = model_summary(out, meta, rows)
      lines += model_lines
  return summary_files.write(out, {"models": metas, "summary": summary, "wall_s": wall_s}, lines)
