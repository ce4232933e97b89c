"""Figures of the SAE binaries: training curves (experiments.train_sae) and layer × step-bin grids
(experiments.evaluate_sae), written as PNG through `experiments.common.atomic_files.save_figure`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from experiments.common import atomic_files
from experiments.reports import palette, plots

plt = plots.plt


def training_curves(layers: Mapping[str, Mapping[str, Any]], path: str) -> None:
  """MSE, explained variance, L0 and the dead fraction over training steps, one line per site."""
  keys = (("mse", "reconstruction MSE (scaled input)"), ("explained_variance", "explained variance (batch)"),
          ("l0", "L0 (features per row)"), ("dead_fraction", "dead features (fraction)"))
  fig, axes = plt.subplots(1, len(keys), figsize=(4.0 * len(keys), 3.2))
  for ax, (key, title) in zip(axes, keys):
    for site, record in layers.items():
      history = record["history"]
      ax.plot([h["step"] for h in history], [h[key] for h in history], marker=".", label=site)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("optimizer step")
    ax.ticklabel_format(axis="y", useOffset=False)
  axes[-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
  fig.tight_layout()
  atomic_files.save_figure(fig, path)


def layer_step_grids(panels: Sequence[tuple[str, np.ndarray, bool]], layers: Sequence[str], bins: Sequence[str],
                     title: str, path: str) -> None:
  """One heatmap per panel (title, grid [layers, bins], diverging: centred at 0), layers down, step bins across,
  each cell annotated with its value."""
  fig, axes = plt.subplots(1, len(panels), figsize=(max(3.5, 0.55 * len(bins) + 2.2) * len(panels),
                                                    max(2.6, 0.45 * len(layers) + 1.6)), squeeze=False)
  for ax, (name, grid, diverging) in zip(axes[0], panels):
    grid = np.asarray(grid, np.float64)
    finite = np.abs(grid[np.isfinite(grid)])
    if diverging:
      bound = float(finite.max()) if finite.size and finite.max() > 0 else 1.0
      image = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="RdBu_r", vmin=-bound, vmax=bound)
    else:
      image = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap=palette.GRID)
    for (i, j), value in np.ndenumerate(grid):
      if np.isfinite(value):
        ax.text(j, i, f"{value:.3g}", ha="center", va="center", fontsize=6)
    ax.set_xticks(range(len(bins)), bins, rotation=60, fontsize=7)
    ax.set_yticks(range(len(layers)), layers, fontsize=7)
    ax.set_xlabel("denoising steps spliced")
    ax.set_title(name, fontsize=9)
    fig.colorbar(image, ax=ax).formatter.set_useOffset(False)
  axes[0][0].set_ylabel("site")
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  atomic_files.save_figure(fig, path)
