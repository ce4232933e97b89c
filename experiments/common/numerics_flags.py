"""--dtype, --attention_impl and --query_chunk (with --matmul_precision from `runtime_flags`) as `Numerics`."""

from __future__ import annotations

import jax
from absl import flags

from experiments.common import numerics
from experiments.common.devices import RuntimeSettings

_DTYPE = flags.DEFINE_enum("dtype", None, list(numerics.DTYPES),
                           "Weight dtype (default: float32 on CPU, the stored dtype on accelerators).")
_ATTENTION_IMPL = flags.DEFINE_enum("attention_impl", "chunked", list(numerics.ATTENTION_IMPLS), "Attention path.")
_QUERY_CHUNK = flags.DEFINE_integer("query_chunk", 128, "Queries per block of the chunked attention path.")


def from_flags(runtime: RuntimeSettings) -> numerics.Numerics:
  """The numerics flags; call after `devices.init_runtime` (the default dtype depends on the backend)."""
  return numerics.Numerics(dtype=numerics.resolve_dtype(_DTYPE.value, jax.default_backend()),
                           matmul_precision=runtime.matmul_precision, attention_impl=_ATTENTION_IMPL.value,
                           query_chunk=_QUERY_CHUNK.value)
