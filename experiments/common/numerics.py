"""How a model is computed — weight dtype, matmul precision, attention path, query chunk and batch-invariant
execution — as one frozen record (its flags are `numerics_flags`; importing the record defines no flag). Every
field changes results, so every binary records it with its results."""

from __future__ import annotations

import dataclasses
from typing import Any


from dlm_jax.session import size_limits
from experiments.common.cli import UserError
from experiments.common.devices import RuntimeSettings

DTYPES = ("float32", "bfloat16", "float16")
ATTENTION_IMPLS = ("chunked", "dense", "fused")


@dataclasses.dataclass(frozen=True)
class Numerics:
  """dtype: float32, bfloat16, float16, or "stored" (the checkpoint's own dtypes); matmul_precision:
  jax_default_matmul_precision; attention_impl: chunked, dense or fused; query_chunk: queries per chunk of
  the chunked path; batch_invariant: the model runs one row at a time, so an item's tokens and statistics
  are bitwise the same whatever its batch (`dlm_jax.sampling.row_by_row`)."""

  dtype: str = "float32"
  matmul_precision: str = "highest"
  attention_impl: str = "chunked"
  query_chunk: int = 128
  batch_invariant: bool = True

  def __post_init__(self):
    if self.dtype not in DTYPES + ("stored",):
      raise UserError(f"--dtype={self.dtype}: expected one of {', '.join(DTYPES)}")
    if self.attention_impl not in ATTENTION_IMPLS:
      raise UserError(f"--attention_impl={self.attention_impl}: expected one of {', '.join(ATTENTION_IMPLS)}")
    if self.query_chunk < 1:
      raise UserError(f"--query_chunk={self.query_chunk}: expected a positive number of queries")
    size_limits.check(query_chunk=self.query_chunk)

  @property
  def weight_dtype(self) -> Any:
    """The dtype to cast the weights to, or None to keep the stored dtypes."""
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    return None if self.dtype == "stored" else jnp.dtype(self.dtype)


def resolve_dtype(flag: str | None, backend: str) -> str:
  """--dtype, else float32 on CPU and "stored" on accelerators."""
  if flag:
    return flag
  return "float32" if backend == "cpu" else "stored"
