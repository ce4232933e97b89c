"""Matplotlib figures of the experiment binaries (Agg backend, no display). Each function takes plain
arrays and returns a `matplotlib.figure.Figure`; `experiments.common.atomic_files.save_figure` writes it as a PNG.

Scores are the incoming attention relative to the uniform share (`dlm_jax.analysis.sinks.relative_scores`): a key
with score c receives c times the attention it would get if every query spread its attention evenly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

try:
  import matplotlib
except ImportError as e:  # a clear message before any work is done (the binaries import this module first)
  raise ImportError("The experiment binaries draw figures with matplotlib: python -m pip install matplotlib") from e

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib import colors  # noqa: E402

_CMAP = "magma"


def _boundaries(ax, prompt_length: int | None, block_starts: Sequence[int] = (), vertical: bool = True) -> None:
  line = ax.axvline if vertical else ax.axhline
  if prompt_length:
    line(prompt_length - 0.5, color="cyan", lw=0.8, ls="--")
  for start in block_starts:
    line(start - 0.5, color="white", lw=0.5, ls=":")


def _boundary_legend(fig, prompt_length: int | None, block_starts: Sequence[int]) -> None:
  """A figure legend saying what the dashed and dotted lines of `_boundaries` mark."""
  from matplotlib.lines import Line2D  # pylint: disable=import-outside-toplevel
  handles = []
  if prompt_length:
    handles.append(Line2D([], [], color="cyan", lw=0.8, ls="--", label="end of prompt"))
  if len(block_starts):
    handles.append(Line2D([], [], color="gray", lw=0.8, ls=":", label="start of a block"))
  if handles:
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, -0.06))


def step_heatmaps(panels: Sequence[tuple[str, np.ndarray]], title: str, *, prompt_length: int | None = None,
                  block_starts: Sequence[int] = (), xlabel: str = "key position",
                  ylabel: str = "denoising step",
                  colorbar_label: str = "score (incoming attention / uniform share)") -> plt.Figure:
  """One heatmap per panel of an array [steps, S] (a value of every key at every step), side by side.

  Colour is a power-law (γ = 0.5) scale so that both sinks and the background are visible; the colour
  bar says what the colour measures. A dashed cyan line marks the end of the prompt, dotted white lines the
  block starts (explained in a legend under the panels)."""
  fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
  for ax, (name, values) in zip(axes[0], panels):
    values = np.asarray(values, np.float32)
    vmax = float(np.nanmax(values)) if values.size and np.isfinite(values).any() else 1.0
    image = ax.imshow(values, aspect="auto", interpolation="nearest", cmap=_CMAP,
                      norm=colors.PowerNorm(0.5, vmin=0.0, vmax=max(vmax, 1e-6)))
    _boundaries(ax, prompt_length, block_starts)
    ax.set_title(name, fontsize=9)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.02).set_label(colorbar_label, fontsize=8)
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  _boundary_legend(fig, prompt_length, block_starts)
  return fig


def score_histogram(edges: np.ndarray, counts: Mapping[str, np.ndarray], epsilon: float, title: str) -> plt.Figure:
  """Histograms (log counts) of the scores of every (step, layer, head, key), one line per model; the
  dashed line is 1 + ε, the ε-rule threshold for a key when the others average 1."""
  fig, ax = plt.subplots(figsize=(6, 3.6))
  centers = 0.5 * (edges[:-1] + edges[1:])
  for label, values in counts.items():
    values = np.asarray(values, np.float64)
    total = max(values.sum(), 1.0)
    ax.step(centers, np.where(values > 0, values / total, np.nan), where="mid", label=label)
  ax.axvline(1 + epsilon, color="k", ls="--", lw=0.8, label=f"1 + ε (ε = {epsilon:g})")
  ax.set_yscale("log")
  ax.set_xlabel("score (incoming attention / uniform share)")
  ax.set_ylabel("fraction of (step, layer, head, key)")
  ax.set_title(title, fontsize=10)
  ax.legend(fontsize=8)
  fig.tight_layout()
  return fig


def layer_head_grid(grid: np.ndarray, title: str, label: str = "mean main-sink score") -> plt.Figure:
  """Heatmap of a [L, N] grid (layers down, heads across)."""
  grid = np.asarray(grid, np.float32)
  fig, ax = plt.subplots(figsize=(max(3.5, 0.35 * grid.shape[1] + 2.5), max(3.0, 0.25 * grid.shape[0] + 1.5)))
  image = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="viridis")
  ax.set_xlabel("head")
  ax.set_ylabel("layer")
  ax.set_title(title, fontsize=10)
  fig.colorbar(image, ax=ax, label=label)
  fig.tight_layout()
  return fig


def largest_sink_tracks(tracks: Mapping[str, np.ndarray], title: str, *, prompt_length: int | None = None,
                        total_length: int | None = None, block_starts: Sequence[int] = ()) -> plt.Figure:
  """Position of the largest sink against the step, one line per (layer, head); steps without a sink
  (−1) are gaps."""
  fig, ax = plt.subplots(figsize=(6, 3.6))
  for label, positions in tracks.items():
    positions = np.asarray(positions, np.float64)
    positions[positions < 0] = np.nan
    ax.plot(np.arange(len(positions)), positions, marker=".", ms=3, lw=1, label=label)
  if prompt_length:
    ax.axhline(prompt_length - 0.5, color="gray", ls="--", lw=0.8, label="end of prompt")
  for i, start in enumerate(block_starts):
    ax.axhline(start - 0.5, color="gray", ls=":", lw=0.5, label="start of a block" if i == 0 else None)
  if total_length:
    ax.set_ylim(-0.5, total_length - 0.5)
  ax.set_xlabel("step")
  ax.set_ylabel("position of the largest sink")
  ax.set_title(title, fontsize=10)
  ax.legend(fontsize=7)
  fig.tight_layout()
  return fig


def nonsink_fraction(epsilons: np.ndarray, fractions: Mapping[str, np.ndarray], epsilon: float,
                     title: str) -> plt.Figure:
  """Fraction of keys that are not sinks against ε, one line per model."""
  fig, ax = plt.subplots(figsize=(5.5, 3.6))
  for label, values in fractions.items():
    ax.plot(epsilons, values, marker=".", ms=3, label=label)
  ax.axvline(epsilon, color="k", ls="--", lw=0.8, label=f"ε = {epsilon:g}")
  ax.axhline(0.96, color="gray", ls=":", lw=0.8, label="96% (Rulli et al.)")
  ax.set_xlabel("ε")
  ax.set_ylabel("fraction of non-sinks")
  ax.set_title(title, fontsize=10)
  ax.legend(fontsize=8)
  fig.tight_layout()
  return fig


def accuracy_vs_masked(ks: Sequence[int], results: Mapping[str, tuple[np.ndarray, np.ndarray]],
                       title: str, ylabel: str = "accuracy") -> plt.Figure:
  """Accuracy ± standard error against the number K of masked sinks, one line per model."""
  fig, ax = plt.subplots(figsize=(5.5, 3.6))
  x = np.arange(len(ks))
  for label, (acc, se) in results.items():
    ax.errorbar(x, acc, yerr=se, marker="o", capsize=3, label=label)
  ax.set_xticks(x, ["none" if k == 0 else f"top-{k}" for k in ks])
  ax.set_xlabel("sinks masked (from the previous step)")
  ax.set_ylabel(ylabel)
  ax.set_ylim(-0.02, 1.02)
  ax.set_title(title, fontsize=10)
  ax.legend(fontsize=8)
  fig.tight_layout()
  return fig


def curves(series: Mapping[str, tuple[np.ndarray, np.ndarray]], title: str, xlabel: str, ylabel: str,
           log_y: bool = False) -> plt.Figure:
  """Line plot of several (x, y) series (loss curves, per-layer values)."""
  fig, ax = plt.subplots(figsize=(5.5, 3.6))
  for label, (x, y) in series.items():
    ax.plot(x, y, marker="." if len(x) < 40 else None, label=label)
  if log_y:
    ax.set_yscale("log")
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  ax.set_title(title, fontsize=10)
  ax.legend(fontsize=8)
  fig.tight_layout()
  return fig


def grouped_bars(groups: Sequence[str], series: Mapping[str, np.ndarray], title: str, ylabel: str,
                 xlabel: str = "layer") -> plt.Figure:
  """Bars of several series over the same groups (e.g. attention mass per layer, per model)."""
  fig, ax = plt.subplots(figsize=(max(5.0, 0.5 * len(groups) * len(series) + 2), 3.6))
  width = 0.8 / max(len(series), 1)
  x = np.arange(len(groups))
  for i, (label, values) in enumerate(series.items()):
    ax.bar(x + (i - (len(series) - 1) / 2) * width, values, width, label=label)
  ax.set_xticks(x, groups)
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  ax.set_title(title, fontsize=10)
  ax.legend(fontsize=8)
  fig.tight_layout()
  return fig


def value_norm_scatter(samples: Mapping[str, np.ndarray], title: str, max_points: int = 10000,
                       seed: int = 0) -> plt.Figure:
  """Zhang et al. Fig. 1 (right): value-vector L2 norms of sampled tokens, one cloud per class (e.g.
  sinks and normal tokens), plotted against the sample index."""
  rng = np.random.default_rng(seed)
  fig, ax = plt.subplots(figsize=(5.5, 3.6))
  for label, values in samples.items():
    values = np.asarray(values, np.float64)
    if values.size > max_points:
      values = rng.choice(values, max_points, replace=False)
    ax.scatter(np.arange(values.size), values, s=2, alpha=0.5, label=f"{label} (n = {values.size})")
  ax.set_xlabel("sampled token")
  ax.set_ylabel("value norm ‖v‖₂")
  ax.set_title(title, fontsize=10)
  ax.legend(fontsize=8, markerscale=4)
  fig.tight_layout()
  return fig


def decoding_mode_panels(ks: Sequence[int], masking: Mapping[str, tuple[np.ndarray, np.ndarray]],
                         layers: Sequence[int], per_layer: Mapping[str, Mapping[str, np.ndarray]],
                         title: str) -> plt.Figure:
  """Decoding modes side by side: accuracy ± standard error against the number K of masked sinks (one
  line per mode), then one panel of per-layer bars per entry of `per_layer` ({panel title: {mode: [L']}})."""
  n = 1 + len(per_layer)
  cols = 2
  rows = (n + cols - 1) // cols
  fig, axes = plt.subplots(rows, cols, figsize=(11, 3.6 * rows), squeeze=False)
  ax = axes[0, 0]
  x = np.arange(len(ks))
  for label, (acc, se) in masking.items():
    ax.errorbar(x, acc, yerr=se, marker="o", capsize=3, label=label)
  ax.set_xticks(x, ["none" if k == 0 else f"top-{k}" for k in ks])
  ax.set_xlabel("sinks masked (from the previous step)")
  ax.set_ylabel("accuracy")
  ax.set_ylim(-0.02, 1.02)
  ax.set_title("accuracy with sinks masked", fontsize=10)
  ax.legend(fontsize=7)
  groups = np.arange(len(layers))
  for index, (panel, series) in enumerate(per_layer.items(), start=1):
    ax = axes[index // cols, index % cols]
    width = 0.8 / max(len(series), 1)
    for i, (label, values) in enumerate(series.items()):
      if len(values) == len(layers):
        ax.bar(groups + (i - (len(series) - 1) / 2) * width, values, width, label=label)
    ax.set_xticks(groups, [str(l) for l in layers])
    ax.set_xlabel("layer")
    ax.set_title(panel, fontsize=10)
    if index == 1:
      ax.legend(fontsize=7)
  for index in range(n, rows * cols):
    axes[index // cols, index % cols].axis("off")
  fig.suptitle(title, fontsize=11)
  fig.tight_layout()
  return fig


def expert_share_panels(layer_names: Sequence[str], sink_shares: np.ndarray, other_shares: np.ndarray,
                        title: str) -> plt.Figure:
  """One bar panel per layer: each expert's share of the sink tokens' routing slots next to its share of
  the other tokens' (sink_shares, other_shares: [layers, E])."""
  n = max(len(layer_names), 1)
  fig, axes = plt.subplots(n, 1, figsize=(max(6.0, 0.35 * sink_shares.shape[-1] + 2), 1.8 * n + 0.8), squeeze=False)
  experts = np.arange(sink_shares.shape[-1])
  for ax, name, sink, other in zip(axes[:, 0], layer_names, sink_shares, other_shares):
    ax.bar(experts - 0.2, sink, width=0.4, label="sink tokens", color="tab:red")
    ax.bar(experts + 0.2, other, width=0.4, label="other tokens", color="tab:gray")
    ax.set_ylabel(name)
    ax.set_xticks(experts)
  axes[-1, 0].set_xlabel("expert")
  axes[0, 0].legend(fontsize=8)
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  return fig
