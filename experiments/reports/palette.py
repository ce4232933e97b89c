"""One colour per meaning, shared by every figure (`experiments.reports.plots`) and the explorer
(`experiments.explore`): the same thing is drawn in the same colour everywhere.

Meanings: a sink and a normal (non-sink) token; the end of the prompt and a block start; a masked,
decoded and just-committed sequence position; and one colour per model, fixed for the embedded models and
smollm2 so that a model keeps its colour across figures and runs (other labels take the remaining colours
in the order they are asked for, `model_colours`).
"""

from __future__ import annotations

from collections.abc import Sequence

SINK = "#d62728"
"""Sinks (red)."""
NORMAL = "#7f7f7f"
"""Normal, non-sink tokens (grey)."""
PROMPT_END = "#17becf"
"""The line at the end of the prompt (cyan)."""
BLOCK_START = "#bcbd22"
"""The lines at block starts (olive)."""
MASKED = "#c7c7c7"
"""A masked (not yet decoded) sequence position (light grey)."""
DECODED = "#1f77b4"
"""A decoded sequence position (blue)."""
JUST_COMMITTED = "#ff7f0e"
"""A position committed at the step shown (orange)."""
THRESHOLD = "#000000"
"""Thresholds and reference values (ε lines, the paper's numbers)."""
HEATMAP = "magma"
"""Colour map of attention heatmaps."""
GRID = "viridis"
"""Colour map of (layer, head) grids."""

MODELS = {"tiny-dlm": "#1f77b4", "tiny-arm": "#2ca02c", "tiny-moe-dlm": "#9467bd", "tiny-uniform-dlm": "#8c564b",
          "smollm2": "#e377c2"}
"""Fixed model colours (no red, grey or orange: those mean sinks, normal tokens and fresh commits)."""
_SPARE = ("#393b79", "#637939", "#843c39", "#7b4173", "#3182bd", "#31a354", "#6b6ecf", "#8ca252")


def model_colours(labels: Sequence[str]) -> dict[str, str]:
  """{label: colour}: the fixed colour of a known model, else the next spare colour (in `labels` order)."""
  spare = [c for c in _SPARE if c not in {MODELS[l] for l in labels if l in MODELS}]
  out = {}
  for label in labels:
    out[label] = MODELS.get(label) or spare[len([l for l in out if l not in MODELS]) % len(spare)]
  return out


def track_colour(index: int) -> str:
  """The colour of the index-th line of a figure whose lines are not models or meanings (e.g. heads)."""
  return _SPARE[index % len(_SPARE)]
