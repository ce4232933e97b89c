"""Which keys and steps of a sampler trace count in an analysis: the steps a row decoded at (the steps run,
less those the row waited through), padding, keys an ARM has not written yet, the fixed-shape steps after
an ARM's row ended."""

from __future__ import annotations

import numpy as np

from dlm_jax.session.checkpoint_bundle import Model
from experiments.common import prompts


def decoded_steps(nfe: int, active_rows: np.ndarray, row: int) -> np.ndarray:
  """int [n]: the indices of the steps row `row` decoded at, in order — of the first `nfe` steps (the later
  entries of a trace's [max_steps, ...] buffers are zeros), those where `active_rows` [max_steps, B] holds
  the row (a row of a batch waits, unchanged, while other rows finish a block under threshold decoding).
  Every per-step analysis reads only these steps; `n` is the row's NFE."""
  return np.flatnonzero(np.asarray(active_rows)[:int(nfe), row])


def step_validity(model: Model, batch: prompts.Prompts, row: int, tokens: np.ndarray, steps: int,
                  queries: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
  """(valid [steps, S] bool, active [steps] bool) for row `row` of a trace with final sequence `tokens` [S],
  over the row's `steps` decoded steps (`decoded_steps`); queries: their computed queries [steps, 2].

  valid: the keys that count at each step — not padding (when the prompts carry a mask), for an ARM
  already written, for block diffusion and DiffusionGemma before the end of the step's block or canvas
  (`queries`' stop; later keys are hidden from its queries), and only at active steps. active: every step of
  a DLM; for an ARM the steps up to the one that produced the row's first stop token (later steps only feed
  pad tokens, an artefact of fixed shapes)."""
  lp, total = batch.ids.shape[1], tokens.shape[0]
  valid = np.ones((steps, total), bool)
  if batch.mask is not None:
    valid[:, :lp] = batch.mask[row][None]
  if model.decoder.block_queries:  # a step's queries see no key after their block or canvas
    if queries is None:
      raise ValueError(f"step_validity of a {model.sampler} trace needs its computed queries.")
    valid &= np.arange(total)[None, :] < np.asarray(queries)[:, 1:2]
  active = np.ones(steps, bool)
  if not model.diffusion:
    valid &= np.arange(total)[None, :] < lp + np.arange(steps)[:, None]
    stops = np.isin(tokens[lp:], list(prompts.stop_ids(model)))
    active = np.arange(steps) <= (int(np.argmax(stops)) if stops.any() else steps)
    valid &= active[:, None]
  return valid, active
