"""The mixture-of-experts feed-forward: router (softmax top-k or grouped sigmoid), stacked experts with
sort-based dispatch, shared experts."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from dlm_jax.config import ModelConfig
from dlm_jax.instrument.site_hooks import SiteHooks, at
from dlm_jax.model.primitives import KERNEL_INIT, SwiGLU, gate_activation, rms_normalize


def route(config: ModelConfig, logits: jax.Array, score_bias: jax.Array | None = None
          ) -> tuple[jax.Array, jax.Array]:
  """The router's choice: float32 logits [M, E] -> (weights [M, k] float32, experts [M, k] int32).

  `config.router` says how (see `ModelConfig`); `score_bias` [E] is the "sigmoid_group" selection bias, or
  the "softmax_topk" bias added to the probabilities (`router_expert_bias`).
  The k slots of a token are in no meaningful order; compare choices as sets.
  """
  c = config
  k = c.experts_per_token
  if c.router in ("softmax_topk", "gemma"):
    probs = jax.nn.softmax(logits, axis=-1)
    if score_bias is not None:
      probs = probs + score_bias.astype(jnp.float32)
    weights, experts = jax.lax.top_k(probs, k)
  else:
    scores = jax.nn.sigmoid(logits)
    choice = scores + score_bias.astype(jnp.float32)
    m, e = choice.shape
    per_group = e // c.router_groups
    group_scores = jnp.sum(jax.lax.top_k(choice.reshape(m, c.router_groups, per_group), 2)[0], axis=-1)
    _, kept_groups = jax.lax.top_k(group_scores, c.router_topk_groups)
    kept = jnp.any(jax.nn.one_hot(kept_groups, c.router_groups, dtype=jnp.bool_), axis=1)
    eligible = jnp.repeat(kept, per_group, axis=1)
    _, experts = jax.lax.top_k(jnp.where(eligible, choice, -jnp.inf), k)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
  if c.router_renormalize:
    weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
  return weights * c.routed_scaling_factor, experts.astype(jnp.int32)


class Router(nnx.Module):
  """Router weight `kernel` [D, E] and, for "sigmoid_group" or with `router_expert_bias`, the expert bias
  `score_bias` [E] (float32 whatever the parameter dtype, as the originals keep it)."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype: Any):
    self.config = config
    self.kernel = nnx.Param(KERNEL_INIT(rngs.params(), (config.d_model, config.n_experts), dtype))
    if self.has_bias:
      self.score_bias = nnx.Param(jnp.zeros((config.n_experts,), jnp.float32))
    if config.router == "gemma":
      self.scale = nnx.Param(jnp.ones((config.d_model,), dtype))
      self.per_expert_scale = nnx.Param(jnp.ones((config.n_experts,), dtype))

  @property
  def has_bias(self) -> bool:
    return self.config.router == "sigmoid_group" or self.config.router_expert_bias

  def __call__(self, x: jax.Array, logits_hook=None) -> tuple[jax.Array, jax.Array]:
    """x [M, D] -> (weights [M, k] float32, experts [M, k] int32); see `route`. logits_hook: None, or a
    function of the float32 logits [M, E] returning the logits to route by (the mlp.hook_router_logits site).

    The "gemma" router first maps x to RMSNorm_noweight(x)·scale·D^(−1/2) and multiplies the chosen
    (renormalised) weights by per_expert_scale.
    """
    kernel = self.kernel[...]
    if self.config.router == "gemma":
      x = rms_normalize(x, self.config.norm_eps) * self.scale[...] * jnp.asarray(self.config.d_model ** -0.5,
                                                                                   x.dtype)
    if self.config.router_fp32:
      logits = jnp.einsum("md,de->me", x.astype(jnp.float32), kernel.astype(jnp.float32))
    else:
      logits = jnp.einsum("md,de->me", x, kernel).astype(jnp.float32)
    if logits_hook is not None:
      logits = logits_hook(logits)
    bias = self.score_bias[...] if self.has_bias else None
    weights, experts = route(self.config, logits, bias)
    if self.config.router == "gemma":
      weights = weights * self.per_expert_scale[...].astype(jnp.float32)[experts]
    return weights, experts


class ExpertKernel(nnx.Module):
  """One projection of all E experts: `kernel` [E, d_in, d_out] (fan-in scaled per expert)."""

  def __init__(self, n_experts: int, d_in: int, d_out: int, *, rngs: nnx.Rngs, dtype: Any):
    init = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1,
                                             batch_axis=(0,))
    self.kernel = nnx.Param(init(rngs.params(), (n_experts, d_in, d_out), dtype))


class Experts(nnx.Module):
  """E SwiGLU experts stored stacked: `gate`, `up` [E, D, F_e] and `down` [E, F_e, D] kernels."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype: Any):
    e, d, f = config.n_experts, config.d_model, config.expert_hidden
    self.config = config
    self.gate = ExpertKernel(e, d, f, rngs=rngs, dtype=dtype)
    self.up = ExpertKernel(e, d, f, rngs=rngs, dtype=dtype)
    self.down = ExpertKernel(e, f, d, rngs=rngs, dtype=dtype)

  def __call__(self, x: jax.Array, weights: jax.Array, experts: jax.Array) -> jax.Array:
    """Σ_k weights[m, k] · Expert_{experts[m, k]}(x[m]): x [M, D], weights [M, k], experts [M, k] -> [M, D].

    Sort-based dispatch: the M·k (token, expert) pairs are sorted by expert (stably, so each expert
    sees its tokens in order), every expert multiplies its contiguous group with `lax.ragged_dot`, and
    the weighted outputs are summed back per token in float32. With `capacity_factor` an expert keeps
    only its first ceil(c·M·k/E) pairs; the others get weight 0.
    """
    c = self.config
    m, k = experts.shape
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // k
    sizes = jnp.bincount(flat, length=c.n_experts).astype(jnp.int32)
    rows = x[token]
    hidden = (gate_activation(c)(jax.lax.ragged_dot(rows, self.gate.kernel[...], sizes))
              * jax.lax.ragged_dot(rows, self.up.kernel[...], sizes))
    out = jax.lax.ragged_dot(hidden, self.down.kernel[...], sizes)
    pair_weights = weights.reshape(-1)[order]
    if c.capacity_factor is not None:
      capacity = math.ceil(c.capacity_factor * m * k / c.n_experts)
      sorted_experts = flat[order]
      rank = jnp.arange(m * k) - (jnp.cumsum(sizes) - sizes)[sorted_experts]
      pair_weights = jnp.where(rank < capacity, pair_weights, 0.0)
    mixed = jnp.zeros((m, x.shape[-1]), jnp.float32).at[token].add(out.astype(jnp.float32) * pair_weights[:, None])
    return mixed.astype(x.dtype)


class MoE(nnx.Module):
  """Mixture-of-experts feed-forward: routed experts (`Router`, `Experts`) plus optional shared experts."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype: Any):
    self.router = Router(config, rngs=rngs, dtype=dtype)
    self.experts = Experts(config, rngs=rngs, dtype=dtype)
    if config.n_shared_experts:
      self.shared = SwiGLU(config.d_model, config.n_shared_experts * config.shared_expert_hidden, rngs=rngs,
                           dtype=dtype, fused=config.fused_projections)

  def __call__(self, x: jax.Array, router_input: jax.Array | None = None, hooks: SiteHooks | None = None
               ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """x [B, T, D] -> (y [B, T, D], (weights [B, T, k] float32, experts [B, T, k] int32): the router's
    choice); the router reads `router_input` [B, T, D] when given (Gemma 4), else x. `hooks` see the
    router logits [B, T, E] as mlp.hook_router_logits."""
    flat = x.reshape(-1, x.shape[-1])
    logits_hook = None
    if hooks is not None and hooks.wants("mlp.hook_router_logits"):
      logits_hook = lambda logits: at(hooks, "mlp.hook_router_logits",  # noqa: E731
                                      logits.reshape(*x.shape[:-1], -1)).reshape(logits.shape)
    weights, experts = self.router(flat if router_input is None else router_input.reshape(flat.shape), logits_hook)
    y = self.experts(flat, weights, experts).reshape(x.shape)
    if hasattr(self, "shared"):
      y = y + self.shared(x)
    k = experts.shape[-1]
    return y, (weights.reshape(x.shape[:-1] + (k,)), experts.reshape(x.shape[:-1] + (k,)))
