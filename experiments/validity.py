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


def remove_padded_prefill_rows(incoming: np.ndarray, model: Model, batch: prompts.Prompts, row: int) -> np.ndarray:
  """ARMs with a left-padded prompt: returns incoming [steps, ..., S] (a copy) without what the pad queries
  of the prefill (step 0) contributed. A pad query sees no key and `dlm_jax.attention` makes its row
  uniform over all S keys, adding 1/S to every key's column sum — when the sampler counts it. Every query
  row sums to 1, so the prefill's total mass minus the number of real queries is the number of pad rows
  counted (all of them, or none with a sampler that reduces over real queries only). DLMs: unchanged."""
  incoming = np.array(incoming, np.float32)
  if not model.diffusion and batch.mask is not None:
    counted_pads = np.rint(incoming[0].sum(-1, keepdims=True) - float(batch.mask[row].sum()))
    incoming[0] -= np.maximum(counted_pads, 0.0) / incoming.shape[-1]
  return incoming
