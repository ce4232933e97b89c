"""Matplotlib figures of the experiment binaries (Agg backend, no display). Each function takes plain
arrays and returns a `matplotlib.figure.Figure`; `experiments.common.atomic_files.save_figure` writes it as a PNG.

Scores are the incoming attention relative to the uniform share (`dlm_jax.analysis.sinks.relative_scores`): a key
with score c receives c times the attention it would get if every query spread its attention evenly.

Conventions: one colour per meaning (`experiments.reports.palette`); integer ticks on discrete axes (steps,
layers, heads, positions; `experiments.reports.figure_axes`); key positions named by their tokens where a
figure has them; legends beside or below the axes, never over the data.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from dlm_jax import extras

# A one-line error naming the extra before any work is done (the binaries import this module first).
matplotlib = extras.require("matplotlib", "plots", "experiments.reports.plots (the binaries' figures)")
matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib import colors  # noqa: E402

from experiments.reports import figure_axes, palette  # noqa: E402

_CMAP = palette.HEATMAP
_OUTSIDE = dict(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
"""Legend placement beside the axes (off the data)."""
_MASKED_K = "sinks masked (from the previous step)"
"""The x label of the accuracy-against-K axes."""


def _integer_axis(ax, n: int, axis: str = "x", labels: Sequence[str] | None = None, max_ticks: int = 8) -> None:
  """Integer ticks (and optional labels) on an axis of n discrete cells."""
  ticks = figure_axes.integer_ticks(n, max_ticks)
  texts = [str(t) for t in ticks] if labels is None else [labels[t] for t in ticks]
  (ax.set_xticks if axis == "x" else ax.set_yticks)(ticks, texts)


def _label(ax, title: str, xlabel: str, ylabel: str, legend_size: int = 8) -> None:
  """Names the axes, titles them and puts their legend beside them."""
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  ax.set_title(title, fontsize=10)
  ax.legend(fontsize=legend_size, **_OUTSIDE)


def _accuracy_lines(ax, ks: Sequence[int], results: Mapping[str, tuple[np.ndarray, np.ndarray]],
                    colours: Mapping[str, str] | None = None) -> None:
  """Accuracy ± standard error against the number K of masked sinks, one line per entry of `results`
  ({label: (accuracy, standard error)}, one value per K); labels without a colour take the colour cycle's."""
  x = np.arange(len(ks))
  for label, (acc, se) in results.items():
    ax.errorbar(x, acc, yerr=se, marker="o", capsize=3, label=label, color=(colours or {}).get(label))
  ax.set_xticks(x, ["none" if k == 0 else f"top-{k}" for k in ks])
  ax.set_ylim(-0.02, 1.02)


def _boundaries(ax, prompt_length: int | None, block_starts: Sequence[int] = (), vertical: bool = True) -> None:
  line = ax.axvline if vertical else ax.axhline
  if prompt_length:
    line(prompt_length - 0.5, color=palette.PROMPT_END, lw=0.8, ls="--")
  for start in block_starts:
    line(start - 0.5, color=palette.BLOCK_START, lw=0.6, ls=":")


def _boundary_legend(fig, prompt_length: int | None, block_starts: Sequence[int], named: bool = False) -> None:
  """A figure legend saying what the dashed and dotted lines of `_boundaries` (and the red marks of the
  named keys) mark."""
  from matplotlib.lines import Line2D  # pylint: disable=import-outside-toplevel
  handles = []
  if named:
    handles.append(Line2D([], [], color=palette.SINK, lw=0, marker="|", ms=8, mew=1.5,
                          label="most attended keys (named in the panel title)"))
  if prompt_length:
    handles.append(Line2D([], [], color=palette.PROMPT_END, lw=0.8, ls="--", label="end of prompt"))
  if len(block_starts):
    handles.append(Line2D([], [], color=palette.BLOCK_START, lw=0.8, ls=":", label="start of a block"))
  if handles:
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, -0.06))


def step_heatmaps(panels: Sequence[tuple[str, np.ndarray]], title: str, *, prompt_length: int | None = None,
                  block_starts: Sequence[int] = (), xlabel: str = "key position",
                  ylabel: str = "denoising step",
                  colorbar_label: str = "score (incoming attention / uniform share)",
                  tokens: Sequence[str] | None = None, named: int = 4, row_labels: Sequence[str] | None = None,
                  columns: int = 4) -> plt.Figure:
  """One heatmap per panel of an array [rows, S] (a value of every key at every step), `columns` per row.

  Colour is a power-law (γ = 0.5) scale so that both sinks and the background are visible; the colour
  bar says what the colour measures. A dashed line marks the end of the prompt, dotted lines the block
  starts (explained in a legend under the panels). Ticks are integers; with `tokens` (the token text at
  every position) the `named` keys of each panel with the largest total are named on its top axis;
  `row_labels` name the rows (e.g. layers) instead of numbering them."""
  cols = min(columns, len(panels))
  rows = -(-len(panels) // cols)
  fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.6 * rows + (0.5 if tokens is not None else 0)),
                           squeeze=False)
  for ax in axes.ravel()[len(panels):]:
    ax.axis("off")
  for ax, (name, values) in zip(axes.ravel(), panels):
    values = np.asarray(values, np.float32)
    vmax = float(np.nanmax(values)) if values.size and np.isfinite(values).any() else 1.0
    image = ax.imshow(values, aspect="auto", interpolation="nearest", cmap=_CMAP,
                      norm=colors.PowerNorm(0.5, vmin=0.0, vmax=max(vmax, 1e-6)))
    _boundaries(ax, prompt_length, block_starts)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    _integer_axis(ax, values.shape[1], "x", max_ticks=7)
    _integer_axis(ax, values.shape[0], "y", row_labels, max_ticks=10)
    if tokens is not None:  # the most attended keys: red marks on the top axis, named in the title
      top = figure_axes.top_positions(values, named)
      twin = ax.secondary_xaxis("top")
      twin.set_xticks(top, [""] * len(top))
      twin.tick_params(length=5, width=1.5, colors=palette.SINK)
      name += "\ntop keys: " + ", ".join(figure_axes.position_labels(top, tokens))
    ax.set_title(name, fontsize=9)
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.02).set_label(colorbar_label, fontsize=8)
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  _boundary_legend(fig, prompt_length, block_starts, named=tokens is not None)
  return fig


def score_histogram(edges: np.ndarray, counts: Mapping[str, np.ndarray], epsilon: float, title: str) -> plt.Figure:
  """Histograms (log counts) of the scores of every (step, layer, head, key), one line per model; the
  dashed line is 1 + ε, the ε-rule threshold for a key when the others average 1. The last bin also holds
  every larger score (the overflow bin): it is shaded and its fraction per model marked with a triangle."""
  fig, ax = plt.subplots(figsize=(7.5, 3.6))
  centers = 0.5 * (edges[:-1] + edges[1:])
  colours = palette.model_colours(list(counts))
  ax.axvspan(edges[-2], edges[-1], color=palette.MASKED, alpha=0.6, lw=0,
             label=f"overflow bin (scores ≥ {edges[-2]:g})")
  for label, values in counts.items():
    values = np.asarray(values, np.float64)
    total = max(values.sum(), 1.0)
    ax.step(centers, np.where(values > 0, values / total, np.nan), where="mid", label=label, color=colours[label])
    if values[-1] > 0:
      ax.plot([centers[-1]], [values[-1] / total], marker="v", color=colours[label], ms=6)
  ax.axvline(1 + epsilon, color=palette.THRESHOLD, ls="--", lw=0.8, label=f"1 + ε (ε = {epsilon:g})")
  ax.set_yscale("log")
  _label(ax, title, "score (incoming attention / uniform share)", "fraction of (step, layer, head, key)")
  fig.tight_layout()
  return fig


def layer_head_grid(grid: np.ndarray, title: str, label: str = "mean main-sink score",
                    layers: Sequence[int] | None = None) -> plt.Figure:
  """Heatmap of a [L', N] grid (layers down, heads across); `layers` are the recorded layers' numbers."""
  grid = np.asarray(grid, np.float32)
  fig, ax = plt.subplots(figsize=(max(4.5, 0.35 * grid.shape[1] + 3.0), max(3.0, 0.25 * grid.shape[0] + 1.5)))
  image = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap=palette.GRID)
  names = [str(l) for l in (layers if layers is not None else range(grid.shape[0]))]
  _integer_axis(ax, grid.shape[1], "x", max_ticks=16)
  _integer_axis(ax, grid.shape[0], "y", names, max_ticks=16)
  ax.set_xlabel("head")
  ax.set_ylabel("layer")
  ax.set_title(title, fontsize=10)
  fig.colorbar(image, ax=ax, label=label)
  fig.tight_layout()
  return fig


def largest_sink_tracks(tracks: Mapping[str, np.ndarray], title: str, *, prompt_length: int | None = None,
                        total_length: int | None = None, block_starts: Sequence[int] = (),
                        tokens: Sequence[str] | None = None, xlabel: str = "step") -> plt.Figure:
  """Position of the largest sink against the step, one line per (layer, head); steps without a sink
  (−1) are gaps. With `tokens` (the token text at every position) the positions the tracks visit are
  labelled "position token" on the y axis."""
  fig, ax = plt.subplots(figsize=(7.5, 3.8))
  visited = set()
  for i, (label, positions) in enumerate(tracks.items()):
    positions = np.asarray(positions, np.float64)
    visited |= {int(p) for p in positions[positions >= 0]}
    positions[positions < 0] = np.nan
    ax.plot(np.arange(len(positions)), positions, marker="o", ms=3, lw=1.2, label=label,
            color=palette.track_colour(i), drawstyle="steps-post")
  if prompt_length:
    ax.axhline(prompt_length - 0.5, color=palette.PROMPT_END, ls="--", lw=0.8, label="end of prompt")
  for i, start in enumerate(block_starts):
    ax.axhline(start - 0.5, color=palette.BLOCK_START, ls=":", lw=0.6, label="start of a block" if i == 0 else None)
  if total_length:
    ax.set_ylim(-0.5, total_length - 0.5)
  if tokens is not None and visited:
    named = figure_axes.most_visited(list(tracks.values()), most=8)
    ax.set_yticks(named, figure_axes.position_labels(named, tokens), fontsize=7)
  n_steps = max((len(p) for p in tracks.values()), default=0)
  _integer_axis(ax, n_steps, "x", max_ticks=12)
  _label(ax, title, xlabel, "largest sink (8 most visited named)" if tokens is not None
         else "position of the largest sink", legend_size=7)
  fig.tight_layout()
  return fig


def nonsink_fraction(epsilons: np.ndarray, fractions: Mapping[str, np.ndarray], epsilon: float,
                     title: str) -> plt.Figure:
  """Fraction of keys that are not sinks against ε, one line per model."""
  fig, ax = plt.subplots(figsize=(7.0, 3.6))
  colours = palette.model_colours(list(fractions))
  for label, values in fractions.items():
    ax.plot(epsilons, values, marker=".", ms=3, label=label, color=colours[label])
  ax.axvline(epsilon, color=palette.THRESHOLD, ls="--", lw=0.8, label=f"ε = {epsilon:g}")
  ax.axhline(0.96, color=palette.THRESHOLD, ls=":", lw=0.8, label="96% (Rulli et al.)")
  _label(ax, title, "ε", "fraction of non-sinks")
  fig.tight_layout()
  return fig


def accuracy_vs_masked(ks: Sequence[int], results: Mapping[str, tuple[np.ndarray, np.ndarray]],
                       title: str, ylabel: str = "accuracy") -> plt.Figure:
  """Accuracy ± standard error against the number K of masked sinks, one line per model."""
  fig, ax = plt.subplots(figsize=(7.0, 3.6))
  _accuracy_lines(ax, ks, results, palette.model_colours(list(results)))
  _label(ax, title, _MASKED_K, ylabel)
  fig.tight_layout()
  return fig


def curves(series: Mapping[str, tuple[np.ndarray, np.ndarray]], title: str, xlabel: str, ylabel: str,
           log_y: bool = False) -> plt.Figure:
  """Line plot of several (x, y) series (loss curves, per-layer values)."""
  fig, ax = plt.subplots(figsize=(5.5, 3.6))
  for i, (label, (x, y)) in enumerate(series.items()):
    ax.plot(x, y, marker="." if len(x) < 40 else None, label=label, color=palette.track_colour(i))
  if log_y:
    ax.set_yscale("log")
  _label(ax, title, xlabel, ylabel)
  fig.tight_layout()
  return fig


def grouped_bars(groups: Sequence[str], series: Mapping[str, np.ndarray], title: str, ylabel: str,
                 xlabel: str = "layer", colours: Mapping[str, str] | None = None) -> plt.Figure:
  """Bars of several series over the same groups (e.g. attention mass per layer, per model); `colours`
  gives a series its meaning's colour (`experiments.reports.palette`)."""
  fig, ax = plt.subplots(figsize=(max(6.0, 0.5 * len(groups) * len(series) + 3), 3.6))
  width = 0.8 / max(len(series), 1)
  x = np.arange(len(groups))
  for i, (label, values) in enumerate(series.items()):
    colour = (colours or {}).get(label, palette.track_colour(i))
    ax.bar(x + (i - (len(series) - 1) / 2) * width, values, width, label=label, color=colour)
  ax.set_xticks(x, groups)
  _label(ax, title, xlabel, ylabel)
  fig.tight_layout()
  return fig


def value_norm_histogram(samples: Mapping[str, np.ndarray], colours: Mapping[str, str], title: str,
                         bins: int = 60) -> plt.Figure:
  """Zhang et al. Fig. 1 (right) as distributions: the value-vector L2 norms of each class of tokens (e.g.
  sinks and normal tokens) as step histograms over shared bins, each normalised to its own count (density),
  the medians dashed; `colours` {class: colour} (`experiments.reports.palette.SINK` / `NORMAL`)."""
  fig, ax = plt.subplots(figsize=(7.5, 3.6))
  finite = [np.asarray(v, np.float64) for v in samples.values() if np.size(v)]
  values_all = np.concatenate(finite) if finite else np.zeros(1)
  edges = np.linspace(float(values_all.min()), float(values_all.max()) + 1e-9, bins + 1)
  for label, values in samples.items():
    values = np.asarray(values, np.float64)
    if not values.size:
      continue
    ax.hist(values, bins=edges, density=True, histtype="stepfilled", alpha=0.25, color=colours[label])
    ax.hist(values, bins=edges, density=True, histtype="step", lw=1.4, color=colours[label],
            label=f"{label} (n = {values.size}, median {np.median(values):.2f})")
    ax.axvline(float(np.median(values)), color=colours[label], ls="--", lw=1)
  _label(ax, title, "value norm ‖v‖₂", "density")
  fig.tight_layout()
  return fig


def moving_sinks(panels: Sequence[tuple[str, np.ndarray]], title: str, *, tokens: Sequence[str],
                 prompt_length: int | None = None, block_starts: Sequence[int] = (),
                 decode_step: np.ndarray | None = None, xlabel: str = "step") -> plt.Figure:
  """Moving sinks: one panel per head (title, largest-sink positions [steps], −1 = none), the position of
  the head's largest sink against the step as a step line, the (at most 10) most visited positions named
  by their tokens on the y axis; with decode_step [S] (the index among the steps shown at which each
  position was decoded; −1 = prompt) a small marker shows when each visited generated position was
  committed."""
  n = max(len(panels), 1)
  cols = min(2, n)
  rows = -(-n // cols)
  fig, axes = plt.subplots(rows, cols, figsize=(6.2 * cols, 3.0 * rows + 0.6), squeeze=False)
  for ax in axes.ravel()[len(panels):]:
    ax.axis("off")
  for ax, (name, track) in zip(axes.ravel(), panels):
    track = np.asarray(track, np.float64)
    visited = sorted({int(p) for p in track[track >= 0]})
    shown = np.where(track >= 0, track, np.nan)
    ax.plot(np.arange(len(track)), shown, drawstyle="steps-post", color=palette.SINK, lw=1.6, marker="o", ms=3,
            label="largest sink")
    if decode_step is not None:  # decode_step in the steps shown (−1: prompt or not among them)
      committed = [(int(decode_step[p]), p) for p in visited if 0 <= decode_step[p] < len(track)]
      if committed:
        ax.scatter([c[0] for c in committed], [c[1] for c in committed], marker="|", s=80,
                   color=palette.JUST_COMMITTED, zorder=3, label="position committed")
    if prompt_length:
      ax.axhline(prompt_length - 0.5, color=palette.PROMPT_END, ls="--", lw=0.8, label="end of prompt")
    for i, start in enumerate(block_starts):
      ax.axhline(start - 0.5, color=palette.BLOCK_START, ls=":", lw=0.6, label="start of a block" if i == 0 else None)
    if visited:
      named = figure_axes.most_visited([track], most=10)
      ax.set_yticks(named, figure_axes.position_labels(named, tokens), fontsize=7)
      ax.set_ylim(visited[0] - 1.5, visited[-1] + 1.5)
    _integer_axis(ax, len(track), "x", max_ticks=12)
    ax.set_title(name, fontsize=9)
    ax.set_xlabel(xlabel)
    ax.grid(axis="y", color=palette.MASKED, lw=0.4)
  handles, labels = axes.ravel()[0].get_legend_handles_labels()
  fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False,
             bbox_to_anchor=(0.5, 0.0))
  fig.suptitle(title, fontsize=10)
  fig.tight_layout(rect=(0, 0.06, 1, 1))
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
  _accuracy_lines(axes[0, 0], ks, masking)
  _label(axes[0, 0], "accuracy with sinks masked", _MASKED_K, "accuracy", legend_size=7)
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
      ax.legend(fontsize=7, **_OUTSIDE)
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
    ax.bar(experts - 0.2, sink, width=0.4, label="sink tokens", color=palette.SINK)
    ax.bar(experts + 0.2, other, width=0.4, label="other tokens", color=palette.NORMAL)
    ax.set_ylabel(name)
    ax.set_xticks(experts)
  axes[-1, 0].set_xlabel("expert")
  axes[0, 0].legend(fontsize=8, **_OUTSIDE)
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  return fig
