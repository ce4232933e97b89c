"""Traced per-row values of the instrument: one value for every row, or one per row."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def row_array(x, batch: int, shape: tuple[int, ...], dtype, what: str) -> jax.Array:
  """x broadcast to [B, shape...]: x may be [shape...] (every row) or [B, shape...]; ValueError (one line,
  starting with `what`) otherwise."""
  x = jnp.asarray(x, dtype)
  if x.shape == shape:
    return jnp.broadcast_to(x, (batch, *shape))
  if x.shape != (batch, *shape):
    raise ValueError(f"{what} must be {list(shape)} or {[batch, *shape]}, got {list(x.shape)}.")
  return x
