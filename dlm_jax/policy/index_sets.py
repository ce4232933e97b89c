"""Variable-size position sets as static-size index sets: a boolean mask over the sequence becomes the first
`budget` selected positions in ascending order, padded, with a validity mask and the count that did not fit.

Policies whose official code computes a varying number of positions per step (d2Cache, Elastic-Cache) decide
a mask; the forward runs a fixed `budget` of query rows. A step is equal to the official one only where
`overflow` is 0 (every selected position fitted).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def mask_to_index_set(mask: jax.Array, budget: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Selected positions of mask [B, S] bool as (indices [B, budget] int32 ascending, valid [B, budget] bool,
  overflow [B] int32). Padding slots repeat the last valid index (or 0 when none is selected), so a gather
  with them stays in range; `overflow` counts the selected positions beyond `budget` (they are dropped:
  the highest positions go first)."""
  if budget < 1:
    raise ValueError(f"budget must be an int >= 1, got {budget!r}.")
  s = mask.shape[-1]
  positions = jnp.arange(s, dtype=jnp.int32)
  order = jnp.argsort(jnp.where(mask, positions, s + positions), axis=-1, stable=True).astype(jnp.int32)
  width = min(budget, s)
  count = jnp.sum(mask, axis=-1, dtype=jnp.int32)
  head = order[:, :width]
  valid = jnp.arange(width)[None, :] < count[:, None]
  last = jnp.take_along_axis(head, jnp.maximum(jnp.minimum(count, width) - 1, 0)[:, None], axis=-1)
  indices = jnp.where(valid, head, jnp.where(count[:, None] > 0, last, 0))
  if width < budget:
    pad = budget - width
    indices = jnp.concatenate([indices, jnp.broadcast_to(indices[:, -1:], (mask.shape[0], pad))], axis=-1)
    valid = jnp.concatenate([valid, jnp.zeros((mask.shape[0], pad), bool)], axis=-1)
  return indices, valid, jnp.maximum(count - budget, 0)
