"""Measures over a finished run under a compute policy (`dlm_jax.policy`): what its decisions left out."""

from __future__ import annotations

import numpy as np


def dropped_attention(incoming: np.ndarray, record: np.ndarray | None, row: int, prompt_width: int, block: int,
                      steps_per_block: int) -> float | None:
  """For Sparse-dLLM: at each block's selection step (its step 1), the share of the incoming attention (every
  query, head mean) on the keys outside the block that falls on the keys the policy drops, averaged over the
  layers and blocks; None for a policy without kept keys. incoming: [steps, L, B, S]; record: [steps, B, L, n]
  (the kept keys, S = none)."""
  if record is None:
    return None
  shares = []
  for step in range(1, incoming.shape[0], steps_per_block) if steps_per_block > 1 else ():
    start = prompt_width + (step // steps_per_block) * block
    outside = np.ones(incoming.shape[-1], bool)
    outside[start:start + block] = False
    for layer, mass in enumerate(incoming[step, :, row]):
      kept = np.zeros_like(outside)
      kept[record[step, row, layer][record[step, row, layer] < outside.size]] = True
      total = mass[outside].sum()
      shares.append(float(mass[outside & ~kept].sum() / total) if total > 0 else 0.0)
  return float(np.mean(shares)) if shares else None
