"""The primitives every Transformer layer is built of: RMSNorm, linear projections, the gated feed-forward."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from dlm_jax.config import ModelConfig
from dlm_jax.instrument.site_hooks import SiteHooks, at

KERNEL_INIT = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")
EMBED_INIT = nnx.initializers.normal(stddev=0.02)


class RMSNorm(nnx.Module):
  """x / sqrt(mean(x²) + eps) computed in float32, cast back to x's dtype, then times the weight; with
  fp32_weight the weight multiplies the float32 value before the cast (Gemma 4). Equal in float32."""

  def __init__(self, dim: int, eps: float, *, dtype: Any, fp32_weight: bool = False):
    self.eps = eps
    self.fp32_weight = fp32_weight
    self.weight = nnx.Param(jnp.ones((dim,), dtype))

  def __call__(self, x: jax.Array) -> jax.Array:
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    if self.fp32_weight:
      return (normed * self.weight[...].astype(jnp.float32)).astype(x.dtype)
    return (normed.astype(x.dtype) * self.weight[...]).astype(x.dtype)


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
  """Weightless RMSNorm over the last axis (Gemma 4 v_norm, router norm, self-conditioning post-norm):
  x / sqrt(mean(x²) + eps) in float32, cast back to x's dtype."""
  xf = x.astype(jnp.float32)
  return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def gate_activation(config: ModelConfig):
  """The gate nonlinearity of every gated feed-forward: SiLU (SwiGLU) or tanh-approximated GELU (GeGLU)."""
  if config.mlp_activation == "gelu_tanh":
    return functools.partial(jax.nn.gelu, approximate=True)
  return jax.nn.silu


def linear(d_in: int, d_out: int, bias: bool, rngs: nnx.Rngs, dtype: Any) -> nnx.Linear:
  return nnx.Linear(d_in, d_out, use_bias=bias, param_dtype=dtype, kernel_init=KERNEL_INIT,
                    bias_init=nnx.initializers.zeros, rngs=rngs)


class SwiGLU(nnx.Module):
  """down(SiLU(gate(x)) ⊙ up(x)) with hidden width `hidden`: [..., D] -> [..., D]."""

  def __init__(self, d_model: int, hidden: int, *, rngs: nnx.Rngs, dtype: Any, activation: str = "silu",
               fused: bool = False):
    self.gate = linear(d_model, hidden, False, rngs, dtype)
    self.up = linear(d_model, hidden, False, rngs, dtype)
    self.down = linear(hidden, d_model, False, rngs, dtype)
    self.activation = activation
    self.fused = fused

  def __call__(self, x: jax.Array, hooks: SiteHooks | None = None) -> jax.Array:
    """x [..., D] -> [..., D]; `hooks` see the hidden activation as mlp.hook_post."""
    gate, up = self.project_gate_up(x)
    if self.activation == "gelu_tanh":  # GeGLU (Gemma)
      return self.down(at(hooks, "mlp.hook_post", jax.nn.gelu(gate, approximate=True) * up))
    return self.down(at(hooks, "mlp.hook_post", jax.nn.silu(gate) * up))

  def project_gate_up(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., D] -> (gate(x), up(x)) [..., hidden] each: two matmuls, or one when `fused`."""
    if self.fused:
      return fused_linear(x, (self.gate, self.up))
    return self.gate(x), self.up(x)


def fused_linear(x: jax.Array, linears: tuple[nnx.Linear, ...]) -> tuple[jax.Array, ...]:
  """The outputs of `linears` (sharing the input x [..., D]) from one matmul over their kernels concatenated
  along the output axis (biases likewise), split back per linear: one [..., F_i] array each."""
  kernels = [linear.kernel[...] for linear in linears]
  y = jnp.matmul(x, jnp.concatenate(kernels, axis=-1).astype(x.dtype))
  if linears[0].bias is not None:
    y = y + jnp.concatenate([linear.bias[...] for linear in linears]).astype(y.dtype)
  ends = [0]
  for kernel in kernels:
    ends.append(ends[-1] + kernel.shape[-1])
  return tuple(y[..., start:end] for start, end in zip(ends, ends[1:]))
