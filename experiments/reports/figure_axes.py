"""The logic behind the figures' axes and choices, kept apart from the drawing (`experiments.reports.plots`) so it
can be tested without rendering: integer ticks on discrete axes, the steps that ran, token labels of key
positions, the top sinks to name, and the documented rule that picks the moving sinks to draw.

Moving-sink rule (`moving_heads`, `most_moving_item`): a head's movement in one generation is the number
of consecutive step pairs, both with a sink, whose largest-sink position differs (steps without a sink are
skipped, so a sink that vanishes and returns elsewhere counts once); ties go to the head whose largest
sink visits more distinct positions, then to the lower (layer, head). The item drawn is the one whose most
moving head moves most (ties: more movement summed over all heads, then the earlier item).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

NICE_STEPS = (1, 2, 5)


def integer_ticks(n: int, max_ticks: int = 8) -> np.ndarray:
  """Integer ticks 0, d, 2d, … below n for an axis of n discrete cells, d the smallest 1/2/5 × 10^k that
  gives at most max_ticks ticks (n ≤ 0: no ticks)."""
  if n <= 0:
    return np.zeros((0,), int)
  scale = 1
  while True:
    for base in NICE_STEPS:
      step = base * scale
      if -(-n // step) <= max_ticks:
        return np.arange(0, n, step)
    scale *= 10


def steps_that_ran(valid: np.ndarray) -> int:
  """The number of leading steps of valid [steps, S] (the keys each step read) up to the last step that
  read any key: the steps after a generation ended (an ARM past EOS) are left out."""
  ran = np.flatnonzero(np.asarray(valid).any(-1))
  return int(ran[-1]) + 1 if ran.size else 0


def token_text(token: str | None) -> str:
  """A token as a short printable label (whitespace shown, None as ?)."""
  if token is None:
    return "?"
  text = token.replace("\n", "⏎").replace("\t", "⇥").replace("Ċ", "⏎").replace("Ġ", "␣").replace(" ", "␣")
  return text if len(text) <= 12 else text[:11] + "…"


def position_labels(positions: Sequence[int], tokens: Sequence[str]) -> list[str]:
  """"position token" labels of key positions (tokens: the token text at every position)."""
  return [f"{int(p)} {token_text(tokens[int(p)])}" for p in positions]


def most_visited(tracks: Sequence[np.ndarray], most: int = 10) -> list[int]:
  """The (at most `most`) positions that the largest-sink tracks [steps] (−1 = none) visit on the most steps
  (ties: the lower position), sorted: the positions worth naming on a crowded axis."""
  found = np.concatenate([np.asarray(t)[np.asarray(t) >= 0] for t in tracks] or [np.zeros(0, int)]).astype(int)
  if not found.size:
    return []
  counts = np.bincount(found)
  order = np.argsort(-counts, kind="stable")[:most]
  return sorted(int(p) for p in order if counts[p] > 0)


def top_positions(scores: np.ndarray, k: int) -> np.ndarray:
  """The k key positions of scores [steps, S] with the largest total over steps (ties: the lower position),
  sorted by position."""
  total = np.nan_to_num(np.asarray(scores, np.float64)).sum(0)
  order = np.argsort(-total, kind="stable")[:k]
  return np.sort(order[total[order] > 0])


def head_movement(track: np.ndarray) -> tuple[int, int]:
  """(moves, distinct positions) of one head's largest-sink positions track [steps] (−1 = no sink)."""
  found = np.asarray(track)[np.asarray(track) >= 0]
  return int((found[1:] != found[:-1]).sum()), int(np.unique(found).size)


def moving_heads(largest: np.ndarray, k: int = 4) -> list[tuple[int, int, int]]:
  """The k (layer index, head, moves) of largest [steps, L', N] whose sinks move most (module docstring)."""
  ranked = []
  for layer in range(largest.shape[1]):
    for head in range(largest.shape[2]):
      moves, distinct = head_movement(largest[:, layer, head])
      ranked.append((-moves, -distinct, layer, head))
  ranked.sort()
  return [(layer, head, -moves) for moves, _, layer, head in ranked[:k]]


def most_moving_item(tracks: Mapping[str, np.ndarray]) -> str | None:
  """The item id (of {id: largest [steps, L', N]}) whose sinks move most (module docstring)."""
  best, best_key = None, None
  for index, (item, largest) in enumerate(tracks.items()):
    moves = [head_movement(largest[:, l, h])[0] for l in range(largest.shape[1]) for h in range(largest.shape[2])]
    key = (max(moves, default=0), sum(moves), -index)
    if best_key is None or key > best_key:
      best, best_key = item, key
  return best


def shown_layers(layers: Sequence[int], most: int = 6) -> list[int]:
  """Indices into the recorded layers to draw: all of them up to `most`, else `most` evenly spaced ones
  from the first to the last."""
  n = len(layers)
  if n <= most:
    return list(range(n))
  return sorted({round(i * (n - 1) / (most - 1)) for i in range(most)})
