"""Where one call's T queries sit among the S sequence positions, for the hooks: contiguous from an offset (a
whole-sequence call: 0; a KV-cache call: its cache offset), or at explicit positions [B, T] (a compute policy's
subset call, `dlm_jax.model.compute_subset`; padded entries equal S).

Captures are placed at these positions of zeros [B, S, ...] (a padded entry writes nothing), and per-position
hook inputs in sequence coordinates ([B, S, ...]: edit positions, edit values, lens targets, a gate's reading)
are read at them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class QueryRows:
  """offset: sequence position of the first query (scalar, may be traced); index: [B, T] int32 the queries'
  sequence positions (ascending, padded with S), or None for offset..offset+T−1. Traced values inside one
  trace; never a jit argument."""

  offset: Any = 0
  index: jax.Array | None = None

  def shifted(self, start, t: int) -> QueryRows:
    """The rows of the call's queries start..start+t−1 (e.g. the logits window at ln_final.hook_normalized)."""
    if self.index is None:
      return QueryRows(offset=jnp.asarray(self.offset, jnp.int32) + start)
    if isinstance(start, int) and start == 0 and self.index.shape[1] == t:
      return self
    return QueryRows(index=jax.lax.dynamic_slice_in_dim(self.index, jnp.asarray(start, jnp.int32), t, axis=1))

  def positions(self, t: int) -> jax.Array:
    """[B | 1, T] int32: the sequence positions of the T queries (S at a padded entry)."""
    if self.index is None:
      return (jnp.asarray(self.offset, jnp.int32) + jnp.arange(t, dtype=jnp.int32))[None]
    return self.index

  def take(self, x: jax.Array, t: int) -> jax.Array:
    """x [B, S, ...] at the T queries: [B, T, ...] (a padded entry reads position S − 1)."""
    if self.index is None:
      return jax.lax.dynamic_slice_in_dim(x, jnp.asarray(self.offset, jnp.int32), t, axis=1)
    index = jnp.minimum(self.index, x.shape[1] - 1)
    return jnp.take_along_axis(x, index.reshape(index.shape + (1,) * (x.ndim - 2)), axis=1)

  def place(self, y: jax.Array, n_seq: int) -> jax.Array:
    """y [B, T, ...] written at the queries' positions of zeros [B, S, ...] (a padded entry writes nothing)."""
    zeros = jnp.zeros((y.shape[0], n_seq, *y.shape[2:]), y.dtype)
    if self.index is None:
      return jax.lax.dynamic_update_slice_in_dim(zeros, y, jnp.asarray(self.offset, jnp.int32), axis=1)
    return jax.vmap(lambda base, i, v: base.at[i].set(v, mode="drop"))(zeros, self.index, y)
