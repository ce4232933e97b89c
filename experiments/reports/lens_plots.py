"""Figures of `experiments.logit_lens`: the lens over steps and layers, and one prompt's positions by token.

Rows of the lens are "embed" (the token embeddings) and the layers 0..L−1 (each block's output; the last is
the model's own prediction), as `dlm_jax.analysis.logit_lens.row_names` gives them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from experiments.reports import figure_axes, palette
from experiments.reports.plots import plt  # the Agg backend, set there


def _labelled_axis(ax, labels: Sequence[str], axis: str, max_ticks: int) -> None:
  """Integer ticks of a discrete axis labelled by `labels`."""
  ticks = figure_axes.integer_ticks(len(labels), max_ticks)
  (ax.set_xticks if axis == "x" else ax.set_yticks)(ticks, [labels[t] for t in ticks])


def _row_labels(rows: Sequence[str]) -> list[str]:
  return [f"L{r}" if r.isdigit() else r for r in rows]


def step_layer_heatmap(values: np.ndarray, steps: Sequence[int], rows: Sequence[str], title: str,
                       colorbar_label: str) -> plt.Figure:
  """Heatmap of values [n_steps, R] (NaN: no position read at that step, left blank), steps down, lens rows
  across."""
  values = np.asarray(values, np.float64)
  fig, ax = plt.subplots(figsize=(max(4.5, 0.6 * len(rows) + 3.0), max(3.5, 0.16 * len(steps) + 2.0)))
  image = ax.imshow(np.ma.masked_invalid(values), aspect="auto", interpolation="nearest", cmap=palette.GRID,
                    vmin=0.0, vmax=1.0)
  _labelled_axis(ax, _row_labels(rows), "x", 16)
  _labelled_axis(ax, [str(s) for s in steps], "y", 12)
  ax.set_xlabel("lens row (embed = token embeddings; L = block output; last = the model's own prediction)", fontsize=8)
  ax.set_ylabel("step (model call)")
  ax.set_title(title, fontsize=9)
  fig.colorbar(image, ax=ax).set_label(colorbar_label, fontsize=8)
  fig.tight_layout()
  return fig


def first_top1_grid(first: np.ndarray, steps: Sequence[int], rows: Sequence[str], tokens: Sequence[str],
                    title: str) -> plt.Figure:
  """For one prompt: first [n_steps, P] the first lens row at which the final token is top-1 (an index into
  `rows`; −1: at no row; −2: the position was not read at that step, left blank), steps down and the P
  positions across, each labelled by its final decoded token."""
  from matplotlib import colors  # pylint: disable=import-outside-toplevel
  first = np.asarray(first)
  n_rows = len(rows)
  cmap = plt.get_cmap(palette.GRID, n_rows)
  listed = colors.ListedColormap([palette.NORMAL] + [cmap(i) for i in range(n_rows)])
  shown = np.ma.masked_where(first == -2, first + 1)
  fig, ax = plt.subplots(figsize=(max(5.0, 0.32 * len(tokens) + 3.0), max(3.5, 0.18 * len(steps) + 2.4)))
  image = ax.imshow(shown, aspect="auto", interpolation="nearest", cmap=listed, vmin=-0.5, vmax=n_rows + 0.5)
  ax.set_xticks(np.arange(len(tokens)), tokens, rotation=90, fontsize=7)
  _labelled_axis(ax, [str(s) for s in steps], "y", 12)
  ax.set_xlabel("generated position, labelled by its final decoded token (blank: already decoded)")
  ax.set_ylabel("step (model call)")
  ax.set_title(title, fontsize=9)
  bar = fig.colorbar(image, ax=ax, ticks=np.arange(n_rows + 1))
  bar.ax.set_yticklabels(["never"] + _row_labels(rows), fontsize=7)
  bar.set_label("first row with the final token top-1", fontsize=8)
  fig.tight_layout()
  return fig

