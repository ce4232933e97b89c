"""Detecting non-finite values (NaN, ±inf) in weights and outputs, on device, in one compiled reduction.

`first_nonfinite(arrays)` reduces every array where it lives (sharded arrays stay sharded) to two scalars —
whether it holds a non-finite value, and the first index along its leading axis that does — so checking a
whole checkpoint costs one pass over the weights and moves a few bytes to the host. `checkpoint.load`
uses it to refuse a checkpoint with NaN weights, naming the tensor and (for stacked block tensors) the layer.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np


@jax.jit
def _scan(arrays: dict[str, jax.Array]) -> dict[str, tuple[jax.Array, jax.Array]]:
  out = {}
  for name, x in arrays.items():
    bad = ~jnp.isfinite(x.reshape(x.shape[:1] + (-1,)) if x.ndim else x.reshape(1, 1))
    rows = jnp.any(bad, axis=1)
    out[name] = (jnp.any(rows), jnp.argmax(rows).astype(jnp.int32))
  return out


def first_nonfinite(arrays: Mapping[str, jax.Array]) -> dict[str, int]:
  """{name: first leading-axis index holding a non-finite value} of the arrays that hold one (sorted by
  name; empty when every value is finite). Integer arrays are skipped."""
  floats = {name: x for name, x in arrays.items() if jnp.issubdtype(x.dtype, jnp.inexact)}
  if not floats:
    return {}
  found = jax.device_get(_scan(floats))
  return {name: int(index) for name, (bad, index) in sorted(found.items()) if bool(np.asarray(bad))}
