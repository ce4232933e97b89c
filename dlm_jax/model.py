"""The one Transformer behind every supported model, as Flax NNX modules, and its pure entry point.

token embedding → L pre-norm blocks (RMSNorm → attention with optional q/k/v bias, optional per-head QK
RMSNorm, full or partial rotate-half RoPE, GQA → residual; RMSNorm → feed-forward → residual) → final
RMSNorm → LM head (untied, or tied to the embedding). The feed-forward is a dense SwiGLU, or in a
mixture-of-experts model (`config.n_experts > 0`) a router choosing k of E SwiGLU experts per token plus
optional always-on shared experts (`MoE`), after `config.first_k_dense` leading dense layers.

The blocks are stored stacked (every block parameter has a leading layer axis) and run with `lax.scan`,
so compile time does not grow with depth. A dense model has one stack `blocks` [L]. An MoE model has
`blocks` [L − k] for its MoE layers and, when k = `first_k_dense` > 0, a second stack `dense_blocks` [k]
for the leading dense layers; the two are scanned one after the other (dense first), and everything that
is per layer outside the parameters (KV cache, per-layer biases, statistics) keeps one [L] axis in
absolute layer order. A `layer_pattern` model (Gemma 4 / DiffusionGemma) stores its sliding layers in
`blocks` [L_s] and its global layers in `global_blocks` [L_g] and runs one scan per maximal run of one
kind, in absolute order (BUILD.md decision 16); its blocks add the Gemma sandwich norms
(`post_attn_norm`, `post_ffn_norm`), the dense GeGLU `mlp` with `post_mlp_norm` in parallel with the
`moe` (`moe_norm`, `post_moe_norm`; router `moe.router.{kernel, scale, per_expert_scale}`) and
`layer_scalar` [1]; global layers without a v projection when `global_k_eq_v`; and the model has
`self_conditioning.{pre_norm.weight, mlp.*}`. Public functions take the params as a pure nested dict
(`init_params`, `forward`); the NNX modules are rebuilt from it inside the traced function.

Parameter tree: `PARAM_AXES` below lists every tensor by flat name (the names joined with "." are the
tensor names of converted checkpoints) with its logical axes, which `dlm_jax.sharding` maps to mesh axes.
Logical axis sizes: layers (the stack's length), vocab V, embed D, heads N·H, kv_heads K·H, mlp F,
expert E, shared_mlp n_shared_experts·shared_expert_hidden. The q/k/v biases exist only when `qkv_bias`,
`attn.{q,k}_norm.weight` [H] only when `qk_norm`; `lm_head.kernel` is absent when `tied_embeddings`. MoE
layers replace `mlp.{gate,up,down}.kernel` by `mlp.router.kernel` [D, E] (+ `mlp.router.score_bias` [E]
for the "sigmoid_group" router), the stacked experts `mlp.experts.{gate,up}.kernel` [E, D, F_e] and
`mlp.experts.down.kernel` [E, F_e, D], and, with shared experts, `mlp.shared.{gate,up,down}.kernel`.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from dlm_jax.attention import MASK_VALUE, NO_BIAS, AttentionBias, AttentionImpl, attention
from dlm_jax.config import ModelConfig
from dlm_jax.rope import apply_rope, proportional_rope_tables, rope_tables
from dlm_jax.stats import NO_STATS, ForwardOutput, StatsSpec

Params = dict[str, Any]

_DENSE_BLOCK_AXES: dict[str, tuple[str | None, ...]] = {
    "attn_norm.weight": ("layers", None),
    "attn.q.kernel": ("layers", "embed", "heads"),
    "attn.q.bias": ("layers", "heads"),
    "attn.k.kernel": ("layers", "embed", "kv_heads"),
    "attn.k.bias": ("layers", "kv_heads"),
    "attn.v.kernel": ("layers", "embed", "kv_heads"),
    "attn.v.bias": ("layers", "kv_heads"),
    "attn.o.kernel": ("layers", "heads", "embed"),
    "attn.q_norm.weight": ("layers", None),
    "attn.k_norm.weight": ("layers", None),
    "mlp_norm.weight": ("layers", None),
    "mlp.gate.kernel": ("layers", "embed", "mlp"),
    "mlp.up.kernel": ("layers", "embed", "mlp"),
    "mlp.down.kernel": ("layers", "mlp", "embed"),
    "post_attn_norm.weight": ("layers", None),
    "post_mlp_norm.weight": ("layers", None),
    "moe_norm.weight": ("layers", None),
    "post_moe_norm.weight": ("layers", None),
    "post_ffn_norm.weight": ("layers", None),
    "layer_scalar": ("layers", None),
}
_MOE_FEED_FORWARD_AXES: dict[str, tuple[str | None, ...]] = {
    "mlp.router.kernel": ("layers", "embed", None),
    "mlp.router.score_bias": ("layers", None),
    "mlp.router.scale": ("layers", None),
    "mlp.router.per_expert_scale": ("layers", None),
    "mlp.experts.gate.kernel": ("layers", "expert", "embed", None),
    "mlp.experts.up.kernel": ("layers", "expert", "embed", None),
    "mlp.experts.down.kernel": ("layers", "expert", None, "embed"),
    "mlp.shared.gate.kernel": ("layers", "embed", "shared_mlp"),
    "mlp.shared.up.kernel": ("layers", "embed", "shared_mlp"),
    "mlp.shared.down.kernel": ("layers", "shared_mlp", "embed"),
}

PARAM_AXES: dict[str, tuple[str | None, ...]] = {
    "embed.embedding": ("vocab", "embed"),
    **{f"blocks.{name}": axes for name, axes in {**_DENSE_BLOCK_AXES, **_MOE_FEED_FORWARD_AXES}.items()},
    **{f"dense_blocks.{name}": axes for name, axes in _DENSE_BLOCK_AXES.items()},
    **{f"global_blocks.{name}": axes for name, axes in _DENSE_BLOCK_AXES.items()},
    **{f"global_blocks.{name.replace('mlp.', 'moe.', 1)}": axes for name, axes in _MOE_FEED_FORWARD_AXES.items()},
    **{f"blocks.{name.replace('mlp.', 'moe.', 1)}": axes for name, axes in _MOE_FEED_FORWARD_AXES.items()},
    "self_conditioning.pre_norm.weight": (None,),
    "self_conditioning.mlp.gate.kernel": ("embed", "mlp"),
    "self_conditioning.mlp.up.kernel": ("embed", "mlp"),
    "self_conditioning.mlp.down.kernel": ("mlp", "embed"),
    "final_norm.weight": (None,),
    "lm_head.kernel": ("embed", "vocab"),
}
"""Logical axes of every parameter (flat name -> one name per dimension; None = never sharded)."""


@struct.dataclass
class KVCache:
  """Keys and values of every layer for cached decoding (RoPE applied).

  keys, values: [L, B, S, K, H] — every layer, in order, for a model whose layers are alike; with
  `config.layer_pattern` only the sliding ("s") layers, in order: [L_s, B, S, K, H].
  global_keys, global_values: [L_g, B, S, K_g, H_g] for the global ("g") layers of a `layer_pattern`
  model (K_g = global_kv_heads, H_g = global_head_dim), else None. Every kind keeps all S positions; the
  sliding window is applied by the attention mask, so the same cache index is the same sequence index
  in every layer.
  """

  keys: jax.Array
  values: jax.Array
  global_keys: jax.Array | None = None
  global_values: jax.Array | None = None

  @classmethod
  def zeros(cls, config: ModelConfig, batch_size: int, max_length: int, dtype: Any = jnp.float32) -> KVCache:
    shapes = _cache_shapes(config, batch_size, max_length)
    arrays = [jnp.zeros(shapes[kind], dtype) for kind in ("s", "s", "g", "g") if kind in shapes]
    return cls(*arrays)


def _cache_shapes(config: ModelConfig, batch: int, length: int) -> dict[str, tuple[int, ...]]:
  """{"s": [L_s, B, S, K, H], "g": [L_g, B, S, K_g, H_g] (layer_pattern models only)}."""
  kinds = config.layer_kinds
  shapes = {"s": (kinds.count("s"), batch, length, config.n_kv_heads, config.head_dim)}
  if config.layer_pattern is not None:
    shapes["g"] = (kinds.count("g"), batch, length, config.global_kv_heads, config.global_head_dim)
  return shapes

_KERNEL_INIT = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")
_EMBED_INIT = nnx.initializers.normal(stddev=0.02)


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


def _activation(config: ModelConfig):
  """The gate nonlinearity of every gated feed-forward: SiLU (SwiGLU) or tanh-approximated GELU (GeGLU)."""
  if config.mlp_activation == "gelu_tanh":
    return functools.partial(jax.nn.gelu, approximate=True)
  return jax.nn.silu


def _linear(d_in: int, d_out: int, bias: bool, rngs: nnx.Rngs, dtype: Any) -> nnx.Linear:
  return nnx.Linear(d_in, d_out, use_bias=bias, param_dtype=dtype, kernel_init=_KERNEL_INIT,
                    bias_init=nnx.initializers.zeros, rngs=rngs)


class Attention(nnx.Module):
  """Multi-head attention with GQA, optional q/k/v bias, optional per-head QK RMSNorm (before RoPE), full or
  partial RoPE, the configured attention pattern and statistics."""

  def __init__(self, config: ModelConfig, *, kind: str = "s", rngs: nnx.Rngs, dtype: Any):
    c = config
    self.config = c
    self.kind = kind
    self.head_dim, self.n_kv_heads = (c.global_head_dim, c.global_kv_heads) if kind == "g" else (c.head_dim,
                                                                                                c.n_kv_heads)
    self.k_eq_v = kind == "g" and c.global_k_eq_v
    h, kv = self.head_dim, self.n_kv_heads
    self.q = _linear(c.d_model, c.n_heads * h, c.qkv_bias, rngs, dtype)
    self.k = _linear(c.d_model, kv * h, c.qkv_bias, rngs, dtype)
    if not self.k_eq_v:
      self.v = _linear(c.d_model, kv * h, c.qkv_bias, rngs, dtype)
    self.o = _linear(c.n_heads * h, c.d_model, False, rngs, dtype)
    if c.qk_norm:
      self.q_norm = RMSNorm(h, c.norm_eps, dtype=dtype, fp32_weight=c.norm_fp32_weight)
      self.k_norm = RMSNorm(h, c.norm_eps, dtype=dtype, fp32_weight=c.norm_fp32_weight)

  def __call__(self, x, cos, sin, *, pairwise_bias, key_bias, query_weights, with_incoming, impl, query_chunk,
               cache=None, cache_offset=0, zero_values=None, structure_key_bias=None, write_cache=True):
    """x [B, T, D] -> (out [B, T, D], incoming [B, Q, N, S] or None, (keys, values) [B, S, K, H] each).

    With `cache` = (keys, values) [B, S, K, H], this call's keys and values are written at sequence
    positions cache_offset..cache_offset+T-1 and the queries attend to the whole cache (S keys).
    zero_values: [B|1, S] bool or None; those key positions contribute a zero value vector (their
    keys, hence their attention weights, are unchanged) — the returned values carry the zeros too.
    structure_key_bias: [1, 1, S] or None, added to key_bias (the decoder's visible key range).
    write_cache: False for a decoder call: the layer attends as if written, but the returned (keys,
    values) are the cache as given.
    """
    c = self.config
    b, t, _ = x.shape
    h, kv = self.head_dim, self.n_kv_heads
    q, k, v = self.project_qkv(x)
    q = q.reshape(b, t, c.n_heads, h)
    k = k.reshape(b, t, kv, h)
    v = v.reshape(b, t, kv, h)
    if c.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    if c.v_norm:
      v = rms_normalize(v, c.norm_eps)
    q = apply_rope(q, cos, sin, fp32=c.rope_fp32)
    k = apply_rope(k, cos, sin, fp32=c.rope_fp32)
    given_cache = cache
    if cache is not None:
      zero = jnp.zeros((), jnp.int32)
      start = (zero, jnp.asarray(cache_offset, jnp.int32), zero, zero)
      k = jax.lax.dynamic_update_slice(cache[0], k.astype(cache[0].dtype), start)
      v = jax.lax.dynamic_update_slice(cache[1], v.astype(cache[1].dtype), start)
    if zero_values is not None:
      v = jnp.where(zero_values[:, :, None, None], jnp.zeros((), v.dtype), v)
    if structure_key_bias is not None:
      key_bias = structure_key_bias if key_bias is None else jnp.maximum(key_bias + structure_key_bias, MASK_VALUE)
    decoder = not write_cache
    window = c.sliding_window if self.kind == "s" and c.layer_pattern is not None and not decoder else None
    scale = 1.0 / math.sqrt(h) if c.attention_scale is None else c.attention_scale
    out, incoming = attention(
        q, k, v, scale=scale, causal=c.causal and not decoder, block_size=c.attention_block_size,
        window=window, pairwise_bias=pairwise_bias, key_bias=key_bias, query_weights=query_weights,
        query_offset=cache_offset, with_incoming=with_incoming, impl=impl, query_chunk=query_chunk)
    if decoder:
      k, v = given_cache
    return self.o(out.reshape(b, t, c.n_heads * h)), incoming, (k, v)

  def project_qkv(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [B, T, D] -> q [B, T, N·H], k, v [B, T, K·H]: three matmuls (benchmarks/fused_projections.py
    measures one matmul over the concatenated kernels instead). With K = V (global DiffusionGemma layers) v is
    k's projection."""
    k = self.k(x)
    return self.q(x), k, k if self.k_eq_v else self.v(x)


class SwiGLU(nnx.Module):
  """down(SiLU(gate(x)) ⊙ up(x)) with hidden width `hidden`: [..., D] -> [..., D]."""

  def __init__(self, d_model: int, hidden: int, *, rngs: nnx.Rngs, dtype: Any, activation: str = "silu"):
    self.gate = _linear(d_model, hidden, False, rngs, dtype)
    self.up = _linear(d_model, hidden, False, rngs, dtype)
    self.down = _linear(hidden, d_model, False, rngs, dtype)
    self.activation = activation

  def __call__(self, x: jax.Array) -> jax.Array:
    gate, up = self.project_gate_up(x)
    if self.activation == "gelu_tanh":  # GeGLU (Gemma)
      return self.down(jax.nn.gelu(gate, approximate=True) * up)
    return self.down(jax.nn.silu(gate) * up)

  def project_gate_up(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., D] -> (gate(x), up(x)) [..., hidden] each: two matmuls (see `Attention.project_qkv`)."""
    return self.gate(x), self.up(x)


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
    self.kernel = nnx.Param(_KERNEL_INIT(rngs.params(), (config.d_model, config.n_experts), dtype))
    if self.has_bias:
      self.score_bias = nnx.Param(jnp.zeros((config.n_experts,), jnp.float32))
    if config.router == "gemma":
      self.scale = nnx.Param(jnp.ones((config.d_model,), dtype))
      self.per_expert_scale = nnx.Param(jnp.ones((config.n_experts,), dtype))

  @property
  def has_bias(self) -> bool:
    return self.config.router == "sigmoid_group" or self.config.router_expert_bias

  def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [M, D] -> (weights [M, k] float32, experts [M, k] int32); see `route`.

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
    hidden = (_activation(c)(jax.lax.ragged_dot(rows, self.gate.kernel[...], sizes))
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
                           dtype=dtype)

  def __call__(self, x: jax.Array, router_input: jax.Array | None = None
               ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """x [B, T, D] -> (y [B, T, D], (weights [B, T, k] float32, experts [B, T, k] int32): the router's
    choice); the router reads `router_input` [B, T, D] when given (Gemma 4), else x."""
    flat = x.reshape(-1, x.shape[-1])
    weights, experts = self.router(flat if router_input is None else router_input.reshape(flat.shape))
    y = self.experts(flat, weights, experts).reshape(x.shape)
    if hasattr(self, "shared"):
      y = y + self.shared(x)
    k = experts.shape[-1]
    return y, (weights.reshape(x.shape[:-1] + (k,)), experts.reshape(x.shape[:-1] + (k,)))


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
      self.mlp = SwiGLU(d, c.mlp_hidden, rngs=rngs, dtype=dtype, activation=c.mlp_activation)
      self.post_mlp_norm = RMSNorm(d, c.norm_eps, dtype=dtype, fp32_weight=c.norm_fp32_weight)
      self.moe_norm = RMSNorm(d, c.norm_eps, dtype=dtype, fp32_weight=c.norm_fp32_weight)
      self.moe = MoE(c, rngs=rngs, dtype=dtype)
      self.post_moe_norm = RMSNorm(d, c.norm_eps, dtype=dtype, fp32_weight=c.norm_fp32_weight)
    elif moe:
      self.mlp = MoE(c, rngs=rngs, dtype=dtype)
    else:
      self.mlp = SwiGLU(d, c.mlp_hidden, rngs=rngs, dtype=dtype, activation=c.mlp_activation)
    if c.sandwich_norms:
      self.post_attn_norm = RMSNorm(d, c.norm_eps, dtype=dtype, fp32_weight=c.norm_fp32_weight)
      self.post_ffn_norm = RMSNorm(d, c.norm_eps, dtype=dtype, fp32_weight=c.norm_fp32_weight)
    if c.layer_scalar:
      self.layer_scalar = nnx.Param(jnp.ones((1,), dtype))

  def __call__(self, x, cos, sin, **attention_kwargs):
    """x [B, T, D] -> (x [B, T, D], incoming [B, Q, N, S] or None, (keys, values) [B, S, K, H], routing):
    routing is the MoE router's (weights [B, T, k] float32, experts [B, T, k] int32), or None in a dense
    block."""
    c = self.config
    attn_out, incoming, kv = self.attn(self.attn_norm(x), cos, sin, **attention_kwargs)
    if c.sandwich_norms:
      attn_out = self.post_attn_norm(attn_out)
    x = x + attn_out
    routing = None
    if c.moe_with_dense_mlp:
      moe_out, routing = self.moe(self.moe_norm(x), x)
      ffn = self.post_mlp_norm(self.mlp(self.mlp_norm(x))) + self.post_moe_norm(moe_out)
    elif isinstance(self.mlp, MoE):
      ffn, routing = self.mlp(self.mlp_norm(x))
    else:
      ffn = self.mlp(self.mlp_norm(x))
    if c.sandwich_norms:
      ffn = self.post_ffn_norm(ffn)
    x = x + ffn
    if c.layer_scalar:
      x = x * self.layer_scalar[...]
    return x, incoming, kv, routing


def _block_stack(config: ModelConfig, n: int, moe: bool, rngs: nnx.Rngs, dtype: Any, kind: str = "s") -> Block:
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
    self.mlp = SwiGLU(config.d_model, config.mlp_hidden, rngs=rngs, dtype=dtype, activation=config.mlp_activation)

  def __call__(self, x: jax.Array, soft: jax.Array | None) -> jax.Array:
    if soft is not None:
      x = x + self.mlp(self.pre_norm(soft))
    return rms_normalize(x, self.eps)


def _layer_runs(config: ModelConfig) -> list[tuple[str, int, int, int]]:
  """Maximal runs of consecutive layers of one kind: (kind, first absolute layer, stop, first index in that
  kind's stack), in absolute order. One run [("s", 0, L, 0)] for a model whose layers are alike."""
  kinds, runs, seen = config.layer_kinds, [], {"s": 0, "g": 0}
  start = 0
  for i in range(1, len(kinds) + 1):
    if i == len(kinds) or kinds[i] != kinds[start]:
      runs.append((kinds[start], start, i, seen[kinds[start]]))
      seen[kinds[start]] += i - start
      start = i
  return runs


class Transformer(nnx.Module):
  """Embedding, stacked blocks (`blocks`, and `dense_blocks` for an MoE model's leading dense layers, or
  `blocks` for the sliding and `global_blocks` for the global layers of a `layer_pattern` model), final
  norm, LM head, and DiffusionGemma's `self_conditioning`."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype: Any = jnp.float32):
    self.config = config
    self.embed = nnx.Embed(config.vocab_size, config.d_model, param_dtype=dtype, embedding_init=_EMBED_INIT,
                           rngs=rngs)
    if config.first_k_dense:
      self.dense_blocks = _block_stack(config, config.first_k_dense, False, rngs, dtype)
    if config.layer_pattern is None:
      self.blocks = _block_stack(config, config.n_layers - config.first_k_dense, config.is_moe, rngs, dtype)
    else:
      self.blocks = _block_stack(config, config.layer_kinds.count("s"), config.is_moe, rngs, dtype, "s")
      self.global_blocks = _block_stack(config, config.n_global_layers, config.is_moe, rngs, dtype, "g")
    self.final_norm = RMSNorm(config.d_model, config.norm_eps, dtype=dtype, fp32_weight=config.norm_fp32_weight)
    if config.self_conditioning:
      self.self_conditioning = SelfConditioning(config, rngs=rngs, dtype=dtype)
    if not config.tied_embeddings:
      self.lm_head = _linear(config.d_model, config.vocab_size, False, rngs, dtype)

  def __call__(self, tokens, positions, *, bias: AttentionBias, query_weights, stats_spec: StatsSpec,
               logits_window, logits_offset, impl, query_chunk, cache: KVCache | None,
               cache_offset, return_hidden: bool, decoder: bool = False,
               self_conditioning_logits: jax.Array | None = None,
               self_conditioning_mask: jax.Array | None = None) -> ForwardOutput:
    """See `forward`. Statistics are computed only in the layers `stats_spec` asks for."""
    c = self.config
    x = self.embed(tokens)
    if c.embed_scale:
      x = x * jnp.asarray(math.sqrt(c.d_model), x.dtype)
    if decoder and c.self_conditioning:
      soft = None
      if self_conditioning_logits is not None:
        table = self.embed.embedding[...]
        probs = jax.nn.softmax(self_conditioning_logits.astype(jnp.float32), axis=-1).astype(table.dtype)
        soft = jnp.einsum("btv,vd->btd", probs, table)
        if c.embed_scale:
          soft = soft * jnp.asarray(math.sqrt(c.d_model), soft.dtype)
        if self_conditioning_mask is not None:
          soft = soft * self_conditioning_mask.astype(soft.dtype)[:, None, None]
      x = self.self_conditioning(x, soft)
    tables = {"s": rope_tables(positions, c.rope_dim, c.rope_theta)}
    if c.layer_pattern is not None:
      tables["g"] = proportional_rope_tables(positions, c.global_head_dim, c.global_rope_theta,
                                             c.global_rope_fraction)
    structure = {"s": None, "g": None}
    if decoder:
      key_index = jnp.arange(cache.keys.shape[2])
      end = cache_offset + tokens.shape[1]
      visible = {"g": key_index < end, "s": key_index < end}
      if c.layer_pattern is not None:
        visible["s"] = visible["s"] & (key_index > cache_offset - c.sliding_window)
      structure = {kind: jnp.where(v, 0.0, MASK_VALUE).astype(jnp.float32)[None, None] for kind, v in visible.items()}
    per_layer = {}
    if bias.pairwise_per_layer:
      per_layer["pairwise_bias"] = bias.pairwise
    if bias.keys_per_layer:
      per_layer["key_bias"] = bias.keys
    shared = {}
    if not bias.pairwise_per_layer:
      shared["pairwise_bias"] = bias.pairwise
    if not bias.keys_per_layer:
      shared["key_bias"] = bias.keys
    kind_cache = {}
    if cache is not None:
      kind_cache["s"] = (cache.keys, cache.values)
      if c.layer_pattern is not None:
        kind_cache["g"] = (cache.global_keys, cache.global_values)
    wanted = stats_spec.enabled
    slots = None
    if wanted and stats_spec.layers is not None:
      slot_of_layer = np.full((c.n_layers,), -1, np.int32)
      slot_of_layer[list(stats_spec.layers)] = np.arange(len(stats_spec.layers), dtype=np.int32)
      slots = jnp.asarray(slot_of_layer)

    def run_block(kind, block, h, kv_cache, layer_biases, with_stats):
      cos, sin = tables[kind]
      extra = {} if structure[kind] is None else {"structure_key_bias": structure[kind], "write_cache": False}
      h, incoming, (keys, values), routing = block(
          h, cos, sin, query_weights=query_weights, with_incoming=with_stats and stats_spec.incoming_attention,
          impl=impl, query_chunk=query_chunk, cache=kv_cache, cache_offset=cache_offset,
          zero_values=bias.zero_values, **extra, **shared, **layer_biases)
      stats = {}
      if with_stats and stats_spec.incoming_attention:
        stats["incoming_attention"] = incoming if stats_spec.per_head else jnp.mean(incoming, axis=2, keepdims=True)
      if with_stats and stats_spec.value_norms:
        stats["value_norms"] = jnp.linalg.norm(values.astype(jnp.float32), axis=-1).transpose(0, 2, 1)
      if with_stats and stats_spec.routing:
        stats.update(_routing_stats(c, routing, h.shape[:2], keys.shape[1], cache_offset))
      return h, (keys, values), stats

    emit_cache = cache is not None and not decoder  # a decoder call reads the cache and returns none

    def layer(kind, block_graph, carry, xs):
      h, buffers = carry
      state, layer_biases, kv_cache, slot = xs
      block = nnx.merge(block_graph, state)
      if slots is None:
        h, kv, stats = run_block(kind, block, h, kv_cache, layer_biases, wanted)
        return (h, buffers), {**stats, **({"cache": kv} if emit_cache else {})}

      def with_stats(h, buffers):
        h, kv, stats = run_block(kind, block, h, kv_cache, layer_biases, True)
        return h, kv, {name: jax.lax.dynamic_update_index_in_dim(buffers[name], stats[name], slot, 0)
                       for name in buffers}

      def without_stats(h, buffers):
        h, kv, _ = run_block(kind, block, h, kv_cache, layer_biases, False)
        return h, kv, buffers

      h, kv, buffers = jax.lax.cond(slot >= 0, with_stats, without_stats, h, buffers)
      return (h, buffers), ({"cache": kv} if emit_cache else {})

    buffers = {}
    if slots is not None:
      buffers = _stat_buffers(c, stats_spec, tokens.shape[0], x.shape[1] if cache is None else cache.keys.shape[2],
                              query_weights)
    layer_slots = jnp.zeros((c.n_layers,), jnp.int32) if slots is None else slots
    if c.layer_pattern is None:
      layer_cache = kind_cache.get("s")
      per_layer_xs = (per_layer, layer_cache, layer_slots)
      stacks = [(self.blocks, 0, c.n_layers)]
      if c.first_k_dense:
        stacks = [(self.dense_blocks, 0, c.first_k_dense), (self.blocks, c.first_k_dense, c.n_layers)]
      carry, stack_ys = (x, buffers), []
      for blocks, start, stop in stacks:
        block_graph, block_state = nnx.split(blocks)
        xs = per_layer_xs
        if len(stacks) > 1:
          xs = jax.tree.map(lambda a, start=start, stop=stop: a[start:stop], per_layer_xs)
        carry, ys = jax.lax.scan(functools.partial(layer, "s", block_graph), carry, (block_state, *xs))
        stack_ys.append(ys)
      x, buffers = carry
      ys = stack_ys[0] if len(stack_ys) == 1 else jax.tree.map(lambda *a: jnp.concatenate(a), *stack_ys)
      new_cache = KVCache(*ys.pop("cache")) if emit_cache else None
    else:
      (x, buffers), ys, new_cache = self._run_pattern(layer, (x, buffers), per_layer, kind_cache, layer_slots,
                                                      emit_cache)
    stats = buffers if slots is not None else ys
    if logits_window is not None:
      start, stop = logits_window
      if isinstance(logits_offset, int) and logits_offset == 0:
        x = x[:, start:stop]
      else:
        x = jax.lax.dynamic_slice_in_dim(x, start + logits_offset, stop - start, axis=1)
    x = self.final_norm(x)
    head = self.embed.embedding[...].T if c.tied_embeddings else self.lm_head.kernel[...]
    logits, hidden = (None, x) if return_hidden else (_head_logits(x, head, c.final_logit_softcap), None)
    return ForwardOutput(logits=logits, incoming_attention=stats.get("incoming_attention"),
                         value_norms=stats.get("value_norms"), routed_experts=stats.get("routed_experts"),
                         routing_weights=stats.get("routing_weights"), cache=new_cache, hidden=hidden)

  def _run_pattern(self, layer, carry, per_layer, kind_cache, layer_slots, emit_cache):
    """The layers of a `layer_pattern` model in absolute order: one `lax.scan` per run of consecutive layers
    of one kind (`_layer_runs`), over the matching slice of `blocks` ("s") or `global_blocks` ("g").

    Per-layer inputs (biases, statistics slots) are sliced by absolute layer, caches by index in their
    kind's stack. Returns (carry, stacked statistics in absolute layer order, new `KVCache` or None).
    """
    stacks = {"s": nnx.split(self.blocks), "g": nnx.split(self.global_blocks)}
    stats_ys, cache_ys = [], {"s": [], "g": []}
    for kind, start, stop, first in _layer_runs(self.config):
      block_graph, block_state = stacks[kind]
      n = stop - start
      take_stack = lambda a, first=first, n=n: a[first:first + n]
      take_layers = lambda a, start=start, stop=stop: a[start:stop]
      xs = (jax.tree.map(take_stack, block_state), jax.tree.map(take_layers, per_layer),
            jax.tree.map(take_stack, kind_cache.get(kind)), layer_slots[start:stop])
      carry, ys = jax.lax.scan(functools.partial(layer, kind, block_graph), carry, xs)
      if "cache" in ys:
        cache_ys[kind].append(ys.pop("cache"))
      stats_ys.append(ys)
    ys = jax.tree.map(lambda *a: jnp.concatenate(a), *stats_ys)
    new_cache = None
    if emit_cache:
      joined = {kind: jax.tree.map(lambda *a: jnp.concatenate(a), *parts) for kind, parts in cache_ys.items()}
      new_cache = KVCache(*joined["s"], *joined["g"])
    return carry, ys, new_cache


def _routing_stats(config: ModelConfig, routing, query_shape: tuple[int, int], n_keys: int, cache_offset
                   ) -> dict[str, jax.Array]:
  """One layer's routing statistics over the S sequence positions: {"routed_experts": [B, S, k] int32,
  "routing_weights": [B, S, k] float32}; the call's T queries sit at cache_offset..cache_offset+T−1 (0
  without a cache, where S = T); other positions, and every position of a dense layer, hold expert −1 and
  weight 0."""
  b, t = query_shape
  k = config.experts_per_token
  experts = jnp.full((b, n_keys, k), -1, jnp.int32)
  weights = jnp.zeros((b, n_keys, k), jnp.float32)
  if routing is not None:
    zero = jnp.zeros((), jnp.int32)
    start = (zero, jnp.asarray(cache_offset, jnp.int32), zero)
    weights = jax.lax.dynamic_update_slice(weights, routing[0].astype(jnp.float32), start)
    experts = jax.lax.dynamic_update_slice(experts, routing[1], start)
  return {"routed_experts": experts, "routing_weights": weights}


def _head_logits(hidden: jax.Array, head: jax.Array, softcap: float | None = None) -> jax.Array:
  """[B, W, D] final-normed hidden states, head [D, V] -> float32 logits [B, W, V] (soft-capped to
  softcap·tanh(logits / softcap) when softcap is given)."""
  logits = jnp.einsum("btd,dv->btv", hidden, head, preferred_element_type=jnp.float32)
  if softcap is not None:
    logits = jnp.tanh(logits / softcap) * softcap
  return logits


def lm_head(params: Params, hidden: jax.Array, *, config: ModelConfig) -> jax.Array:
  """The LM head on final-normed hidden states [B, W, D] (`forward(..., return_hidden=True)`): float32
  logits [B, W, V], the same values `forward` returns for those positions."""
  head = params["embed"]["embedding"].T if config.tied_embeddings else params["lm_head"]["kernel"]
  return _head_logits(hidden, head, config.final_logit_softcap)


def _stat_buffers(config: ModelConfig, spec: StatsSpec, batch: int, n_keys: int, query_weights) -> dict:
  """Zero buffers [L', B, Q, N', S] / [L', B, K, S] filled layer by layer when a layer subset is asked for."""
  n = len(spec.layers)
  buffers = {}
  if spec.incoming_attention:
    groups = 1 if query_weights is None else query_weights.shape[1]
    heads = config.n_heads if spec.per_head else 1
    buffers["incoming_attention"] = jnp.zeros((n, batch, groups, heads, n_keys), jnp.float32)
  if spec.value_norms:
    buffers["value_norms"] = jnp.zeros((n, batch, config.n_kv_heads, n_keys), jnp.float32)
  if spec.routing:
    buffers["routed_experts"] = jnp.full((n, batch, n_keys, config.experts_per_token), -1, jnp.int32)
    buffers["routing_weights"] = jnp.zeros((n, batch, n_keys, config.experts_per_token), jnp.float32)
  return buffers


@functools.lru_cache(maxsize=64)
def _graphdef(config: ModelConfig) -> nnx.GraphDef:
  return nnx.graphdef(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))


def init_params(config: ModelConfig, key: jax.Array, dtype: Any = jnp.float32) -> Params:
  """Random parameters (nested dict of arrays; see the module docstring for the tree)."""
  return nnx.to_pure_dict(nnx.state(Transformer(config, rngs=nnx.Rngs(params=key), dtype=dtype)))


def abstract_params(config: ModelConfig, dtype: Any = jnp.bfloat16) -> Params:
  """The parameter tree as `jax.ShapeDtypeStruct` leaves, without allocating anything."""
  return jax.eval_shape(lambda: init_params(config, jax.random.key(0), dtype))


def param_count(config: ModelConfig) -> int:
  """Number of parameters of `config`, from abstract shapes."""
  return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(abstract_params(config)))


def active_param_count(config: ModelConfig) -> int:
  """Non-embedding parameters one token passes through: everything except the embedding table and the
  LM head, with the routed experts counted k/E (the k experts a token is sent to). Equals
  `param_count` minus the vocabulary matrices for a dense model."""
  total = 0
  for name, leaf in flatten_params(abstract_params(config)).items():
    if name in ("embed.embedding", "lm_head.kernel"):
      continue
    size = math.prod(leaf.shape)
    if ".mlp.experts." in name or ".moe.experts." in name:
      size = size // config.n_experts * config.experts_per_token
    total += size
  return total


def flatten_params(params: Params) -> dict[str, Any]:
  """{"blocks.attn.q.kernel": array, ...}: the tensor names used by converted checkpoints."""
  flat = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    flat[".".join(str(p.key) for p in path)] = leaf
  return flat


def unflatten_params(flat: dict[str, Any]) -> Params:
  """Inverse of `flatten_params`."""
  params: Params = {}
  for name, leaf in flat.items():
    node = params
    *parents, last = name.split(".")
    for part in parents:
      node = node.setdefault(part, {})
    node[last] = leaf
  return params


def _check_inputs(config, tokens, positions, bias, query_weights, stats_spec, logits_window, cache, decoder=False,
                  self_conditioning_logits=None, self_conditioning_mask=None):
  if tokens.ndim != 2:
    raise ValueError(f"tokens must be [B, T] integer ids, got shape {tokens.shape}.")
  b, t = tokens.shape
  if positions is not None and positions.shape != (b, t):
    raise ValueError(f"positions must have the tokens' shape [B, T] = {(b, t)}, got {positions.shape}.")
  n_keys = t
  if cache is not None:
    shapes = _cache_shapes(config, b, cache.keys.shape[2])
    got = {"s": (cache.keys, cache.values), "g": (cache.global_keys, cache.global_values)}
    for kind, expected in shapes.items():
      arrays = got[kind]
      if any(a is None or a.shape != expected for a in arrays):
        names = "keys and values" if kind == "s" else "global_keys and global_values"
        found = [None if a is None else tuple(a.shape) for a in arrays]
        raise ValueError(f"cache {names} must be [L, B, S, K, H] = {expected}, got {found[0]} and {found[1]}; "
                         "build the cache with KVCache.zeros(config, ...).")
    n_keys = cache.keys.shape[2]
  if decoder and cache is None:
    raise ValueError("forward(decoder=True) reads the prompt from a KVCache; pass cache= (filled by a causal "
                     "call) and cache_offset= (the prompt length).")
  if self_conditioning_logits is not None:
    if not (decoder and config.self_conditioning):
      raise ValueError("self_conditioning_logits need forward(decoder=True) on a model with "
                       "config.self_conditioning=True.")
    if self_conditioning_logits.shape != (b, t, config.vocab_size):
      raise ValueError(f"self_conditioning_logits must be [B, T, V] = {(b, t, config.vocab_size)}, got "
                       f"{tuple(self_conditioning_logits.shape)}.")
  if self_conditioning_mask is not None and (self_conditioning_logits is None
                                             or self_conditioning_mask.shape != (b,)):
    raise ValueError(f"self_conditioning_mask must be [B] = {(b,)} and needs self_conditioning_logits; got "
                     f"{getattr(self_conditioning_mask, 'shape', None)}.")
  if stats_spec.value_norms and config.layer_pattern is not None:
    raise ValueError("StatsSpec.value_norms is not available for a layer_pattern model (its sliding and global "
                     "layers have different kv heads); ask for incoming_attention only.")
  bias.check(n_layers=config.n_layers, batch=b, n_heads=config.n_heads, n_queries=t, n_keys=n_keys)
  stats_spec.check_layers(config.n_layers)
  if stats_spec.routing and not config.is_moe:
    raise ValueError(f"StatsSpec.routing asks for routing statistics, but {config.name} is a dense model "
                     "(n_experts = 0); leave routing False.")
  if stats_spec.query_groups and (query_weights is None or query_weights.shape[1] != stats_spec.query_groups):
    got = None if query_weights is None else query_weights.shape
    raise ValueError(f"StatsSpec.query_groups={stats_spec.query_groups} needs query_weights of shape "
                     f"[B, {stats_spec.query_groups}, T]; got {got}.")
  if not stats_spec.query_groups and query_weights is not None:
    raise ValueError("query_weights were given but StatsSpec.query_groups is 0; set query_groups to "
                     "query_weights.shape[1].")
  if logits_window is not None:
    start, stop = logits_window
    if not 0 <= start < stop <= t:
      raise ValueError(f"logits_window must be (start, stop) with 0 <= start < stop <= T={t}, got {logits_window}.")


def forward(
    params: Params,
    tokens: jax.Array,
    *,
    config: ModelConfig,
    bias: AttentionBias = NO_BIAS,
    positions: jax.Array | None = None,
    query_weights: jax.Array | None = None,
    stats_spec: StatsSpec = NO_STATS,
    logits_window: tuple[int, int] | None = None,
    logits_offset: jax.Array | int = 0,
    attention_impl: AttentionImpl = "chunked",
    query_chunk: int = 128,
    cache: KVCache | None = None,
    cache_offset: jax.Array | int = 0,
    return_hidden: bool = False,
    decoder: bool = False,
    self_conditioning_logits: jax.Array | None = None,
    self_conditioning_mask: jax.Array | None = None,
) -> ForwardOutput:
  """Pure forward pass of the Transformer described by `config`: full, windowed or KV-cached.

  Jit it with `config`, `stats_spec`, `logits_window`, `attention_impl`, `query_chunk`, `return_hidden` and
  `decoder` static.

  DiffusionGemma's encoder and decoder are the same weights called two ways. Encoder: a plain call of
  the (causal) model, with a cache to keep the prompt's keys and values — `forward(prompt [B, P],
  cache=KVCache.zeros(config, B, S), cache_offset=0)` fills cache positions [0, P) (sliding layers see
  themselves and the W−1 previous positions). Decoder: `forward(canvas [B, T], cache=that cache,
  cache_offset=P, decoder=True, self_conditioning_logits=None | [B, T, V])` attends bidirectionally over
  the canvas and to cache positions [0, P) (sliding layers: [P−W+1, P)); the canvas is placed at
  positions P..P+T−1 (RoPE and key index), so the cache needs S >= P + T; keys at >= P + T are hidden;
  the cache is read, never written (`ForwardOutput.cache` is None), and statistics address the S cache
  positions as keys (the prompt keys, then the canvas at [P, P+T)).

  Args:
    params: parameter tree from `init_params` or `dlm_jax.checkpoint`.
    tokens: [B, T] int token ids.
    config: the model configuration (static).
    bias: `AttentionBias` added to the attention scores (key masks, pairwise masks, zero-value keys),
      shared by all layers or per layer as its flags say. Its key axis S is T, or the cache length.
    positions: [B, T] int RoPE positions; default 0..T-1 (cache_offset + 0..T-1 with a cache) in every row.
    query_weights: [B, Q, T] query-group weights for the statistics (see `StatsSpec.query_groups`).
    stats_spec: which statistics to return (static).
    logits_window: (start, stop) positions whose logits are computed; None computes all T.
    logits_offset: a traced int shifting the window to (start + offset, stop + offset), which must stay
      inside [0, T] (out-of-range offsets are clamped, as `lax.dynamic_slice` does); e.g. the current block
      of a semi-autoregressive sampler inside a compiled loop.
    attention_impl: "chunked" (exact, O(N·chunk·S) memory), "dense" (reference) or "fused".
    query_chunk: queries per block in the chunked path.
    cache: a `KVCache` ([L, B, S, K, H]); this call's keys and values are written at sequence positions
      cache_offset..cache_offset+T-1 and the queries attend to all S cache positions (for a causal model
      the causal mask hides the slots after each query, so unwritten slots are never seen; with
      `config.attention_block_size` each query sees the slots up to the end of its own block, so a call
      should cover whole blocks, e.g. the current block [s, e) at cache_offset=s, or hide the block's
      unwritten slots with a key bias). Biases and
      statistics then address the S cache positions as keys; values zeroed by the bias are also zero in
      the returned cache.
    cache_offset: sequence index of the first token (scalar, may be traced); used with `cache`.
    return_hidden: return the final-normed hidden states of the window (`ForwardOutput.hidden`) instead of
      logits; `lm_head` turns any slice of them into logits (a sampler that chooses the positions it needs
      inside the compiled loop).
    decoder: a DiffusionGemma decoder call (see above); needs `cache`.
    self_conditioning_logits: [B, T, V] logits of the previous denoising step fed to the self-conditioning
      module (decoder calls of a `config.self_conditioning` model); None gives the zero signal.
    self_conditioning_mask: [B] bool or None; rows set to False get the zero signal, as if no logits were
      given for them (HF `self_conditioning_mask`; a sampler's first step inside a compiled loop).

  Returns:
    `ForwardOutput`: float32 logits [B, W, V], the requested statistics in the layout of
    `dlm_jax.stats.ForwardOutput` ([L', B, Q, N', S] incoming attention), and the updated cache (None
    without a cache).
  """
  _check_inputs(config, tokens, positions, bias, query_weights, stats_spec, logits_window, cache, decoder,
                self_conditioning_logits, self_conditioning_mask)
  if positions is None:
    start = 0 if cache is None else cache_offset
    positions = jnp.broadcast_to(start + jnp.arange(tokens.shape[1]), tokens.shape)
  model = nnx.merge(_graphdef(config), params)
  return model(tokens, positions, bias=bias, query_weights=query_weights, stats_spec=stats_spec,
               logits_window=logits_window, logits_offset=logits_offset, impl=attention_impl,
               query_chunk=query_chunk, cache=cache, cache_offset=0 if cache is None else cache_offset,
               return_hidden=return_hidden, decoder=decoder, self_conditioning_logits=self_conditioning_logits,
               self_conditioning_mask=self_conditioning_mask)
