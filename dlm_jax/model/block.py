"""One Transformer block, blocks stored stacked for `lax.scan`, and DiffusionGemma's self-conditioning."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from dlm_jax.config import ModelConfig
from dlm_jax.instrument.site_hooks import SiteHooks, at
from dlm_jax.model.attention_layer import Attention, AttentionCall
from dlm_jax.model.primitives import RMSNorm, SwiGLU, rms_normalize
from dlm_jax.model.moe import MoE


class Block(nnx.Module):
  """One pre-norm Transformer block; its feed-forward is a dense SwiGLU or, with `moe`, an `MoE`."""

  def __init__(self, config: ModelConfig, *, moe: bool = False, kind: str = "s", rngs: nnx.Rngs, dtype: Any):
    c = config
    self.config = c
    d = c.d_model
    self.attn_norm = RMSNorm(d, c.norm_eps, dtype=dtype, fp32_weight=c.norm_fp32_weight)
    self.attn = Attention(c, kind=kind, rngs=rngs, dtype=dtype)
    self.mlp_norm = RMSNorm(d, c.norm_eps, dtype=dtype, fp32_weight=c.norm_fp32_weight)
    if c.moe_with_dense_mlp:
      self.mlp = SwiGLU(d, c.mlp_hidden, rngs=rngs, dtype=dtype, activation=c.mlp_activation,
                          fused=c.fused_projections)
      self.post_mlp_norm = RMSNorm(d, c.norm_eps, dtype=dtype, fp32_weight=c.norm_fp32_weight)
      self.moe_norm = RMSNorm(d, c.norm_eps, dtype=dtype, fp32_weight=c.norm_fp32_weight)
      self.moe = MoE(c, rngs=rngs, dtype=dtype)
      self.post_moe_norm = RMSNorm(d, c.norm_eps, dtype=dtype, fp32_weight=c.norm_fp32_weight)
    elif moe:
      self.mlp = MoE(c, rngs=rngs, dtype=dtype)
    else:
      self.mlp = SwiGLU(d, c.mlp_hidden, rngs=rngs, dtype=dtype, activation=c.mlp_activation,
                          fused=c.fused_projections)
    if c.sandwich_norms:
      self.post_attn_norm = RMSNorm(d, c.norm_eps, dtype=dtype, fp32_weight=c.norm_fp32_weight)
      self.post_ffn_norm = RMSNorm(d, c.norm_eps, dtype=dtype, fp32_weight=c.norm_fp32_weight)
    if c.layer_scalar:
      self.layer_scalar = nnx.Param(jnp.ones((1,), dtype))

  def __call__(self, x, cos, sin, call: AttentionCall, cache=None, hooks: SiteHooks | None = None):
    """x [B, T, D] -> (x [B, T, D], the attention's `AttentionReadings`, routing):
    routing is the MoE router's (weights [B, T, k] float32, experts [B, T, k] int32), or None in a dense
    block. call: the attention layer's `AttentionCall`; cache: its (keys, values) or None; `hooks`: the layer's
    `SiteHooks` (`dlm_jax.instrument.sites`) or None."""
    c = self.config
    x = at(hooks, "hook_resid_pre", x)
    attn_out, readings = self.attn(self.attn_norm(x), cos, sin, call, cache, hooks)
    if c.sandwich_norms:
      attn_out = self.post_attn_norm(attn_out)
    x = at(hooks, "hook_resid_mid", x + at(hooks, "hook_attn_out", attn_out))
    routing = None
    if c.moe_with_dense_mlp:
      moe_out, routing = self.moe(self.moe_norm(x), x, hooks=hooks)
      ffn = self.post_mlp_norm(self.mlp(self.mlp_norm(x), hooks)) + self.post_moe_norm(moe_out)
    elif isinstance(self.mlp, MoE):
      ffn, routing = self.mlp(self.mlp_norm(x), hooks=hooks)
    else:
      ffn = self.mlp(self.mlp_norm(x), hooks)
    if c.sandwich_norms:
      ffn = self.post_ffn_norm(ffn)
    x = x + at(hooks, "hook_mlp_out", ffn)
    if c.layer_scalar:
      x = x * self.layer_scalar[...]
    return at(hooks, "hook_resid_post", x), readings, routing


def block_stack(config: ModelConfig, n: int, moe: bool, rngs: nnx.Rngs, dtype: Any, kind: str = "s") -> Block:
  """n blocks stored as one `Block` whose parameters have a leading [n] axis."""
  make = lambda r: Block(config, moe=moe, kind=kind, rngs=r, dtype=dtype)
  block_graph = nnx.graphdef(nnx.eval_shape(lambda: make(nnx.Rngs(0))))
  keys = jax.random.split(rngs.params(), n)
  stacked = jax.vmap(lambda key: nnx.state(make(nnx.Rngs(params=key))))(keys)
  return nnx.merge(block_graph, stacked)


class SelfConditioning(nnx.Module):
  """DiffusionGemma's self-conditioning (decoder only): a gated MLP of width mlp_hidden between a weighted
  pre-norm and a weightless post-norm.

  x [B, T, D] (scaled token embeddings), soft [B, T, D] or None (the previous step's soft embeddings
  softmax(logits)·E·√D) -> RMSNorm_noweight(x + MLP(pre_norm(soft))); with soft None the MLP term is 0.
  """

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype: Any):
    self.eps = config.norm_eps
    self.pre_norm = RMSNorm(config.d_model, config.norm_eps, dtype=dtype, fp32_weight=config.norm_fp32_weight)
    self.mlp = SwiGLU(config.d_model, config.mlp_hidden, rngs=rngs, dtype=dtype, activation=config.mlp_activation,
                      fused=config.fused_projections)

  def __call__(self, x: jax.Array, soft: jax.Array | None) -> jax.Array:
    if soft is not None:
      x = x + self.mlp(self.pre_norm(soft))
    return rms_normalize(x, self.eps)
