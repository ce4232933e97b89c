"""Detecting non-finite values (NaN, ±inf) in weights and outputs, on device, in one compiled reduction.

`first_nonfinite(arrays)` reduces every array to two values — whether it holds a non-finite value, and the
first index along its leading axis that does — so checking a whole checkpoint costs one pass over the
weights. Arrays on accelerators are reduced where they live (sharded arrays stay sharded) by one compiled
program, moving a few bytes to the host; arrays whose devices are all CPUs are read in place with NumPy
(no program to compile: the same pass, without the compile time that would otherwise be paid once per
model configuration). `checkpoint.load` uses it to refuse a checkpoint with NaN weights, naming the tensor
and (for stacked block tensors) the layer.
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


def _host_first(x: np.ndarray) -> int | None:
  rows = ~np.isfinite(x.reshape(x.shape[:1] + (-1,)) if x.ndim else x.reshape(1, 1)).all(axis=1)
  return int(np.argmax(rows)) if rows.any() else None


def _on_cpu(x) -> bool:
  return not isinstance(x, jax.Array) or (x.is_fully_addressable and all(d.platform == "cpu" for d in x.devices()))


def first_nonfinite(arrays: Mapping[str, jax.Array | np.ndarray]) -> dict[str, int]:
  """{name: first leading-axis index holding a non-finite value} of the arrays that hold one (sorted by
  name; empty when every value is finite). Integer arrays are skipped."""
  floats = {name: x for name, x in arrays.items() if jnp.issubdtype(x.dtype, jnp.inexact)}
  found = {name: _host_first(np.asarray(x)) for name, x in floats.items() if _on_cpu(x)}
  on_device = {name: x for name, x in floats.items() if name not in found}
  if on_device:
    for name, (bad, index) in jax.device_get(_scan(on_device)).items():
      found[name] = int(index) if bool(np.asarray(bad)) else None
  return {name: index for name, index in sorted(found.items()) if index is not None}
