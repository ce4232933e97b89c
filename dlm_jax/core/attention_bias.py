"""The attention bias: what a model call adds to attention scores, and the finite mask value.

It sits below both `dlm_jax.model` (which applies it) and `dlm_jax.instrument` (whose interventions build it),
so neither package imports the other for it. Shapes use the axis letters of `dlm_jax.model.attention`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
"""Additive bias that removes a key (finite, so sums of masks stay finite after clamping)."""

@struct.dataclass
class AttentionBias:
  """What one model call adds to attention; every array may be None.

  pairwise: [B|1, N|1, T|1, S] shared by all layers, or [L, B|1, N|1, T|1, S] when `pairwise_per_layer`.
  keys: [B|1, N|1, S] shared by all layers, or [L, B|1, N|1, S] when `keys_per_layer` (broadcast over
    queries; the memory-light way to remove keys: padding, sinks).
  zero_values: [B|1, S] bool, True = that key's value vector is replaced by zeros in every layer (its
    attention weights are unchanged).
  pairwise_per_layer, keys_per_layer: static flags saying that the array has a leading [L] axis.

  Use `MASK_VALUE` to remove a key. Sums clamp at MASK_VALUE, so stacked masks stay finite; a shared bias
  added to a per-layer one broadcasts over the layers.
  """

  pairwise: jax.Array | None = None
  keys: jax.Array | None = None
  zero_values: jax.Array | None = None
  pairwise_per_layer: bool = struct.field(pytree_node=False, default=False)
  keys_per_layer: bool = struct.field(pytree_node=False, default=False)

  def __add__(self, other: AttentionBias) -> AttentionBias:
    zero_values = self.zero_values
    if zero_values is None or other.zero_values is None:
      zero_values = other.zero_values if zero_values is None else zero_values
    else:
      zero_values = zero_values | other.zero_values
    return AttentionBias(pairwise=_add_biases(self.pairwise, other.pairwise),
                         keys=_add_biases(self.keys, other.keys), zero_values=zero_values,
                         pairwise_per_layer=self.pairwise_per_layer or other.pairwise_per_layer,
                         keys_per_layer=self.keys_per_layer or other.keys_per_layer)

  def check(self, *, n_layers: int, batch: int, n_heads: int, n_queries: int, n_keys: int) -> None:
    """Raises ValueError naming the field whose shape does not fit a call with these sizes."""
    layer = lambda per_layer: [(n_layers,)] if per_layer else []
    expected = {
        "pairwise": (self.pairwise, layer(self.pairwise_per_layer) + [(batch, 1), (n_heads, 1), (n_queries, 1)]),
        "keys": (self.keys, layer(self.keys_per_layer) + [(batch, 1), (n_heads, 1)]),
        "zero_values": (self.zero_values, [(batch, 1)]),
    }
    for name, (array, leading) in expected.items():
      if array is None:
        continue
      allowed = leading + [(n_keys,)]
      if array.ndim != len(allowed) or any(size not in sizes for size, sizes in zip(array.shape, allowed)):
        shape = ", ".join("|".join(map(str, sizes)) for sizes in allowed)
        raise ValueError(f"AttentionBias.{name} must have shape [{shape}], got {tuple(array.shape)}.")

  def concat_batch(self, other: AttentionBias, batch: int) -> AttentionBias:
    """One bias for the 2B batch [self rows; other rows] (each side's rows: `batch`, or 1 = broadcast);
    a side without an array gets zeros (no bias) or False (no zeroed values)."""
    return AttentionBias(
        pairwise=_concat_rows(self.pairwise, other.pairwise, batch, int(self.pairwise_per_layer
                                                                      or other.pairwise_per_layer), 0.0),
        keys=_concat_rows(self.keys, other.keys, batch, int(self.keys_per_layer or other.keys_per_layer), 0.0),
        zero_values=_concat_rows(self.zero_values, other.zero_values, batch, 0, False),
        pairwise_per_layer=self.pairwise_per_layer or other.pairwise_per_layer,
        keys_per_layer=self.keys_per_layer or other.keys_per_layer)


NO_BIAS = AttentionBias()


def _add_biases(a: jax.Array | None, b: jax.Array | None) -> jax.Array | None:
  """Sum of two broadcastable biases, clamped at MASK_VALUE."""
  if a is None or b is None:
    return b if a is None else a
  return jnp.maximum(a + b, MASK_VALUE)


def _concat_rows(a, b, batch: int, batch_axis: int, fill):
  """Concatenates two (broadcastable) arrays along `batch_axis`, each side broadcast to `batch` rows."""
  if a is None and b is None:
    return None
  like = a if a is not None else b
  a = jnp.full(like.shape, fill, like.dtype) if a is None else a
  b = jnp.full(like.shape, fill, like.dtype) if b is None else b
  shape = list(jnp.broadcast_shapes(a.shape, b.shape))
  shape[batch_axis] = batch
  return jnp.concatenate([jnp.broadcast_to(a, shape), jnp.broadcast_to(b, shape)], axis=batch_axis)
