"""Shared by the compute policies: a boolean choice over positions turned into ascending indices of a
fixed budget plus a validity mask, and the number checks of their settings."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def ascending_positions(chosen: jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
  """The chosen positions of each row in ascending order, padded to a static budget.

  chosen: [B, W] bool; size: the budget (a Python int, 0 <= size <= W). Returns (indices [B, size]
  int32, valid [B, size] bool): the first `count` entries of a row are its chosen positions ascending
  (count = min(#chosen, size)), the rest are that row's unchosen positions, ascending, with valid False
  (real positions, so a gather with them stays in range; their results must be ignored).
  """
  if not 0 <= size <= chosen.shape[-1]:
    raise ValueError(f"position budget must be in [0, {chosen.shape[-1]}], got {size}.")
  order = jnp.argsort(~chosen, axis=-1, stable=True)[:, :size].astype(jnp.int32)
  count = jnp.sum(chosen, axis=-1, dtype=jnp.int32)
  valid = jnp.arange(size, dtype=jnp.int32)[None, :] < count[:, None]
  return order, valid


def is_number(value: Any) -> bool:
  """True for an int or float that is not a bool."""
  return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_integer(value: Any) -> bool:
  """True for an int that is not a bool."""
  return isinstance(value, int) and not isinstance(value, bool)
