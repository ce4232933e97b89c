"""Which keys and steps of a sampler trace count in an analysis (padding, keys an ARM has not written
yet, the fixed-shape steps after an ARM's row ended), and the ARM prefill correction."""

from __future__ import annotations

import numpy as np

from experiments import prompts
from experiments.checkpoints import Model


def step_validity(model: Model, batch: prompts.Prompts, row: int, tokens: np.ndarray, steps: int) -> tuple[np.ndarray,
                                                                                                        np.ndarray]:
  """(valid [steps, S] bool, active [steps] bool) for row `row` of a trace with final canvas `tokens` [S].

  valid: the keys that count at each step — not padding (when the prompts carry a mask), for an ARM
  already written, and only at active steps. active: every step of a DLM; for an ARM the steps up to the
  one that produced the row's first stop token (later steps only feed pad tokens, an artefact of fixed
  shapes)."""
  lp, total = batch.ids.shape[1], tokens.shape[0]
  valid = np.ones((steps, total), bool)
  if batch.mask is not None:
    valid[:, :lp] = batch.mask[row][None]
  active = np.ones(steps, bool)
  if not model.diffusion:
    valid &= np.arange(total)[None, :] < lp + np.arange(steps)[:, None]
    stops = np.isin(tokens[lp:], list(prompts.stop_ids(model)))
    active = np.arange(steps) <= (int(np.argmax(stops)) if stops.any() else steps)
    valid &= active[:, None]
  return valid, active
