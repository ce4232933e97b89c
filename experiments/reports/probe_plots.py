"""Figures of `experiments.probe_grid`: a metric over sites (layers) × step bins or × position classes, each cell
labelled with its value; blank where no probe was fitted."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from experiments.reports import figure_axes, palette
from experiments.reports.plots import plt  # the Agg backend, set there


def grid_figure(values: np.ndarray, rows: Sequence[str], columns: Sequence[str], *, title: str, xlabel: str,
                ylabel: str, metric: str, vmin: float, vmax: float) -> plt.Figure:
  """Heatmap of values [len(rows), len(columns)] (NaN left blank), rows labelled by site, columns by bin."""
  values = np.asarray(values, np.float64)
  fig, ax = plt.subplots(figsize=(max(5.0, 0.5 * len(columns) + 3.5), max(3.0, 0.45 * len(rows) + 2.0)))
  image = ax.imshow(np.ma.masked_invalid(values), aspect="auto", interpolation="nearest", cmap=palette.GRID,
                    vmin=vmin, vmax=vmax)
  xt = figure_axes.integer_ticks(len(columns), 16)
  ax.set_xticks(xt, [columns[i] for i in xt], rotation=60 if len(columns) > 8 else 0, fontsize=7)
  ax.set_yticks(np.arange(len(rows)), list(rows), fontsize=7)
  if values.size <= 160:
    for (r, c), v in np.ndenumerate(values):
      if np.isfinite(v):
        ax.text(c, r, f"{v:.2f}", ha="center", va="center", fontsize=6)
  ax.set_xlabel(xlabel, fontsize=8)
  ax.set_ylabel(ylabel, fontsize=8)
  ax.set_title(title, fontsize=9)
  fig.colorbar(image, ax=ax).set_label(metric, fontsize=8)
  fig.tight_layout()
  return fig
