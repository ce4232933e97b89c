"""Figures of `experiments.steering_sweep`: a per-step quantity for several coefficients in one panel per
schedule (steps on x), and one prompt's answer tokens per coefficient with the tokens that differ from the
baseline's highlighted."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from matplotlib import colors

from experiments.reports import figure_axes, palette, plots

plt = plots.plt


def per_step_panels(panels: Mapping[str, Mapping[str, np.ndarray]], title: str, ylabel: str,
                    colours: Mapping[str, str] | None = None):
  """One panel per schedule ({schedule: {line label: [n] values per step, NaN where nothing was read}});
  colours: a colour per line label (default: the palette's track colours)."""
  fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels) + 1.5, 3.6), sharey=True, squeeze=False)
  for ax, (schedule, lines) in zip(axes[0], panels.items()):
    for i, (label, values) in enumerate(lines.items()):
      values = np.asarray(values, np.float64)
      ax.plot(np.arange(len(values)), values, marker="." if len(values) < 40 else None, label=label,
              color=colours[label] if colours and label in colours else palette.track_colour(i))
    plots._integer_axis(ax, len(next(iter(lines.values()))))  # pylint: disable=protected-access
    ax.set_title(schedule, fontsize=10)
    ax.set_xlabel("denoising step (model call)")
  axes[0][0].set_ylabel(ylabel)
  axes[0][-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  return fig


def ordered_colours(labels: Sequence[str], baseline: str) -> dict[str, str]:
  """Colours along a diverging map for labels in order (e.g. coefficients from negative to positive), the
  baseline in black."""
  cmap = plt.get_cmap("coolwarm")
  n = max(len(labels) - 1, 1)
  return {label: "#000000" if label == baseline else colors.to_hex(cmap(i / n)) for i, label in enumerate(labels)}


def answer_tokens(rows: Mapping[str, Sequence[str | None]], baseline: str, title: str):
  """A grid: one row per coefficient, one column per generated position, each cell its token's text; cells
  whose token differs from row `baseline`'s are highlighted."""
  names = list(rows)
  width = max(len(v) for v in rows.values())
  fig, ax = plt.subplots(figsize=(min(0.55 * width + 2.0, 40.0), 0.45 * len(names) + 1.4))
  base = rows[baseline]
  for y, name in enumerate(names):
    for x, token in enumerate(rows[name]):
      differs = name != baseline and token != base[x]
      ax.add_patch(plt.Rectangle((x - 0.5, y - 0.5), 1, 1, color=palette.JUST_COMMITTED if differs else "white",
                                 alpha=0.6 if differs else 1.0))
      ax.text(x, y, figure_axes.token_text(token), ha="center", va="center", fontsize=7)
  ax.set_xlim(-0.5, width - 0.5)
  ax.set_ylim(len(names) - 0.5, -0.5)
  ax.set_yticks(range(len(names)), names)
  plots._integer_axis(ax, width)  # pylint: disable=protected-access
  ax.set_xlabel("generated position")
  ax.set_title(title, fontsize=10)
  fig.tight_layout()
  return fig
