"""PRNG keys of a sampler run: one key for the whole batch, or one key per row.

With one key (the default) every draw covers the batch at once, as the original samplers do. With one key
per row — a typed key array of shape [B], e.g. `jax.random.fold_in(seed_key, item_id)` per item — every
draw of row b depends only on its own key and its own row, so an item's sample is the same whatever batch
it is in and whichever row it takes. (A draw whose shape per row depends on the batch breaks that: the
LLaDA steps that need whole-sequence logits draw over the sequence, whose width is the batch's longest
prompt plus G.)

`per_row` is a static flag set once by the driver (`Run.row_keys`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def as_run_key(key: jax.Array | None, batch: int) -> tuple[jax.Array, bool]:
  """(typed key, per_row) from what a caller passed: None (key(0)), one key (typed, or a raw uint32 [2]) or
  [B] typed keys (or raw uint32 [B, 2]). Raises ValueError naming the shapes accepted."""
  if key is None:
    return jax.random.key(0), False
  key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
  if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    if key.dtype != jnp.uint32 or key.ndim not in (1, 2) or key.shape[-1] != 2:
      raise ValueError(f"key must be a PRNG key (jax.random.key), [B] keys, or raw uint32 keys [2] / [B, 2]; "
                       f"got shape {key.shape} of {key.dtype}.")
    key = jax.random.wrap_key_data(key)
  if key.shape == ():
    return key, False
  if key.shape != (batch,):
    raise ValueError(f"per-row keys must have the batch shape ({batch},), got {key.shape}.")
  return key, True


def split(key: jax.Array, num: int, per_row: bool) -> tuple[jax.Array, ...]:
  """`num` new keys (each [B] when per_row)."""
  if not per_row:
    return tuple(jax.random.split(key, num))
  keys = jax.vmap(lambda k: jax.random.split(k, num))(key)  # [B, num]
  return tuple(keys[:, i] for i in range(num))


def _rows(draw, key, shape, per_row):
  if not per_row:
    return draw(key, shape)
  return jax.vmap(lambda k: draw(k, shape[1:]))(key)


def uniform(key: jax.Array, shape: tuple[int, ...], dtype, minval, maxval, per_row: bool) -> jax.Array:
  """U(minval, maxval) draws of `shape` (leading axis B)."""
  return _rows(lambda k, s: jax.random.uniform(k, s, dtype, minval=minval, maxval=maxval), key, shape, per_row)


def gumbel(key: jax.Array, shape: tuple[int, ...], dtype, per_row: bool) -> jax.Array:
  """Standard Gumbel draws of `shape` (leading axis B)."""
  return _rows(lambda k, s: jax.random.gumbel(k, s, dtype), key, shape, per_row)


def categorical(key: jax.Array, logits: jax.Array, per_row: bool) -> jax.Array:
  """One draw per leading position of logits [B, ..., V] over its last axis: [B, ...] int."""
  if not per_row:
    return jax.random.categorical(key, logits, axis=-1)
  return jax.vmap(lambda k, l: jax.random.categorical(k, l, axis=-1))(key, logits)


def keep_rows(active: jax.Array, new: jax.Array, old: jax.Array) -> jax.Array:
  """[B] keys: `new` where active [B] bool, else `old` (rows that wait keep their key, so a row's draws do
  not depend on how long it waited for the rest of its batch); one key with a scalar `active` likewise."""
  data = jnp.where(active[..., None], jax.random.key_data(new), jax.random.key_data(old))
  return jax.random.wrap_key_data(data, impl=jax.random.key_impl(new))
