"""--dtype, --attention_impl, --query_chunk and --batch_invariant (with --matmul_precision from `runtime_flags`) as `Numerics`."""

from __future__ import annotations

import jax
from absl import flags

from experiments.common import numerics
from experiments.common.devices import RuntimeSettings

_DTYPE = flags.DEFINE_enum("dtype", None, list(numerics.DTYPES),
                           "Weight dtype (default: float32 on CPU, the stored dtype on accelerators).")
_ATTENTION_IMPL = flags.DEFINE_enum("attention_impl", "chunked", list(numerics.ATTENTION_IMPLS), "Attention path.")
_QUERY_CHUNK = flags.DEFINE_integer("query_chunk", 128, "Queries per block of the chunked attention path.")
_BATCH_INVARIANT = flags.DEFINE_bool("batch_invariant", True, "Run the model one row at a time, so that an item's "
                                     "tokens and statistics are bitwise the same at any --batch_size and with any "
                                     "neighbours (--nobatch_invariant: one batched call, faster, last-bit "
                                     "differences that can flip a decoding choice).")


def from_flags(runtime: RuntimeSettings) -> numerics.Numerics:
  """The numerics flags; call after `devices.init_runtime` (the default dtype depends on the backend)."""
  return numerics.Numerics(dtype=numerics.resolve_dtype(_DTYPE.value, jax.default_backend()),
                           matmul_precision=runtime.matmul_precision, attention_impl=_ATTENTION_IMPL.value,
                           query_chunk=_QUERY_CHUNK.value, batch_invariant=_BATCH_INVARIANT.value)
