"""Fused q/k/v and gate/up projections, concatenated at trace time, for measuring whether they pay.

`fused()` is a context manager: programs traced inside it compute q, k, v with one matmul over
[Wq Wk Wv] (and the q/k/v biases concatenated likewise) and gate, up with one matmul over [Wg Wu], then
split the result. The parameters keep their layout (the concatenation is part of the traced program), so
any checkpoint runs either way; the results differ by float rounding only. Only programs traced inside
the context are affected (e.g. `jax.jit(f).lower(...)` inside it); entering and leaving it clears JAX's
trace caches (jit would otherwise reuse a trace made outside), and it is not thread-safe.
The denoising benchmark's option comparison measures it end to end (`--compare_fused_projections`).
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp


def _fused_linear(x: jax.Array, linears) -> tuple[jax.Array, ...]:
  """The outputs of `linears` (nnx.Linear sharing input x [..., D]) from one matmul, split per linear."""
  kernels = [linear.kernel[...] for linear in linears]
  y = jnp.matmul(x, jnp.concatenate(kernels, axis=-1).astype(x.dtype))
  if linears[0].bias is not None:
    y = y + jnp.concatenate([linear.bias[...] for linear in linears]).astype(y.dtype)
  ends = [0]
  for kernel in kernels:
    ends.append(ends[-1] + kernel.shape[-1])
  return tuple(y[..., start:end] for start, end in zip(ends, ends[1:]))


def _qkv(self, x):
  return _fused_linear(x, (self.q, self.k, self.v))


def _gate_up(self, x):
  return _fused_linear(x, (self.gate, self.up))


@contextlib.contextmanager
def fused():
  """Within the context, `Attention.project_qkv` and `SwiGLU.project_gate_up` trace one matmul each."""
  from dlm_jax import model  # pylint: disable=import-outside-toplevel
  saved = model.Attention.project_qkv, model.SwiGLU.project_gate_up
  jax.clear_caches()  # jit reuses traces of the same function: without this the swap could go unseen
  model.Attention.project_qkv, model.SwiGLU.project_gate_up = _qkv, _gate_up
  try:
    yield
  finally:
    model.Attention.project_qkv, model.SwiGLU.project_gate_up = saved
    jax.clear_caches()
