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
absolute layer order. Public functions take the params as a pure nested dict
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

from dlm_jax.attention import NO_BIAS, AttentionBias, AttentionImpl, attention
from dlm_jax.config import ModelConfig
from dlm_jax.rope import apply_rope, rope_tables
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
}
_MOE_FEED_FORWARD_AXES: dict[str, tuple[str | None, ...]] = {
    "mlp.router.kernel": ("layers", "embed", None),
    "mlp.router.score_bias": ("layers", None),
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
    "final_norm.weight": (None,),
    "lm_head.kernel": ("embed", "vocab"),
}
"""Logical axes of every parameter (flat name -> one name per dimension; None = never sharded)."""


@struct.dataclass
class KVCache:
  """Keys and values of every layer for autoregressive decoding: [L, B, S, K, H] each (RoPE applied)."""

  keys: jax.Array
  values: jax.Array

  @classmethod
  def zeros(cls, config: ModelConfig, batch_size: int, max_length: int, dtype: Any = jnp.float32) -> KVCache:
    shape = (config.n_layers, batch_size, max_length, config.n_kv_heads, config.head_dim)
    return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

_KERNEL_INIT = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")
_EMBED_INIT = nnx.initializers.normal(stddev=0.02)


class RMSNorm(nnx.Module):
  """x / sqrt(mean(x²) + eps) computed in float32, cast back to x's dtype, then times the weight."""

  def __init__(self, dim: int, eps: float, *, dtype: Any):
    self.eps = eps
    self.weight = nnx.Param(jnp.ones((dim,), dtype))

  def __call__(self, x: jax.Array) -> jax.Array:
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    return (normed.astype(x.dtype) * self.weight[...]).astype(x.dtype)


def _linear(d_in: int, d_out: int, bias: bool, rngs: nnx.Rngs, dtype: Any) -> nnx.Linear:
  return nnx.Linear(d_in, d_out, use_bias=bias, param_dtype=dtype, kernel_init=_KERNEL_INIT,
                    bias_init=nnx.initializers.zeros, rngs=rngs)


class Attention(nnx.Module):
  """Multi-head attention with GQA, optional q/k/v bias, optional per-head QK RMSNorm (before RoPE), full or
  partial RoPE, the configured attention pattern and statistics."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype: Any):
    c = config
    self.config = c
    self.q = _linear(c.d_model, c.n_heads * c.head_dim, c.qkv_bias, rngs, dtype)
    self.k = _linear(c.d_model, c.n_kv_heads * c.head_dim, c.qkv_bias, rngs, dtype)
    self.v = _linear(c.d_model, c.n_kv_heads * c.head_dim, c.qkv_bias, rngs, dtype)
    self.o = _linear(c.n_heads * c.head_dim, c.d_model, False, rngs, dtype)
    if c.qk_norm:
      self.q_norm = RMSNorm(c.head_dim, c.norm_eps, dtype=dtype)
      self.k_norm = RMSNorm(c.head_dim, c.norm_eps, dtype=dtype)

  def __call__(self, x, cos, sin, *, pairwise_bias, key_bias, query_weights, with_incoming, impl, query_chunk,
               cache=None, cache_offset=0, zero_values=None):
    """x [B, T, D] -> (out [B, T, D], incoming [B, Q, N, S] or None, (keys, values) [B, S, K, H] each).

    With `cache` = (keys, values) [B, S, K, H], this call's keys and values are written at sequence
    positions cache_offset..cache_offset+T-1 and the queries attend to the whole cache (S keys).
    zero_values: [B|1, S] bool or None; those key positions contribute a zero value vector (their
    keys, hence their attention weights, are unchanged) — the returned values carry the zeros too.
    """
    c = self.config
    b, t, _ = x.shape
    q, k, v = self.project_qkv(x)
    q = q.reshape(b, t, c.n_heads, c.head_dim)
    k = k.reshape(b, t, c.n_kv_heads, c.head_dim)
    v = v.reshape(b, t, c.n_kv_heads, c.head_dim)
    if c.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    q = apply_rope(q, cos, sin, fp32=c.rope_fp32)
    k = apply_rope(k, cos, sin, fp32=c.rope_fp32)
    if cache is not None:
      zero = jnp.zeros((), jnp.int32)
      start = (zero, jnp.asarray(cache_offset, jnp.int32), zero, zero)
      k = jax.lax.dynamic_update_slice(cache[0], k.astype(cache[0].dtype), start)
      v = jax.lax.dynamic_update_slice(cache[1], v.astype(cache[1].dtype), start)
    if zero_values is not None:
      v = jnp.where(zero_values[:, :, None, None], jnp.zeros((), v.dtype), v)
    out, incoming = attention(
        q, k, v, scale=1.0 / math.sqrt(c.head_dim), causal=c.causal, block_size=c.attention_block_size,
        pairwise_bias=pairwise_bias, key_bias=key_bias, query_weights=query_weights, query_offset=cache_offset,
        with_incoming=with_incoming, impl=impl, query_chunk=query_chunk)
    return self.o(out.reshape(b, t, c.n_heads * c.head_dim)), incoming, (k, v)

  def project_qkv(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [B, T, D] -> q [B, T, N·H], k, v [B, T, K·H]: three matmuls (benchmarks/fused_projections.py
    measures one matmul over the concatenated kernels instead)."""
    return self.q(x), self.k(x), self.v(x)


class SwiGLU(nnx.Module):
  """down(SiLU(gate(x)) ⊙ up(x)) with hidden width `hidden`: [..., D] -> [..., D]."""

  def __init__(self, d_model: int, hidden: int, *, rngs: nnx.Rngs, dtype: Any):
    self.gate = _linear(d_model, hidden, False, rngs, dtype)
    self.up = _linear(d_model, hidden, False, rngs, dtype)
    self.down = _linear(hidden, d_model, False, rngs, dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    gate, up = self.project_gate_up(x)
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
  if c.router == "softmax_topk":
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

  @property
  def has_bias(self) -> bool:
    return self.config.router == "sigmoid_group" or self.config.router_expert_bias

  def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [M, D] -> (weights [M, k] float32, experts [M, k] int32); see `route`."""
    kernel = self.kernel[...]
    if self.config.router_fp32:
      logits = jnp.einsum("md,de->me", x.astype(jnp.float32), kernel.astype(jnp.float32))
    else:
      logits = jnp.einsum("md,de->me", x, kernel).astype(jnp.float32)
    bias = self.score_bias[...] if self.has_bias else None
    return route(self.config, logits, bias)


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
    hidden = (jax.nn.silu(jax.lax.ragged_dot(rows, self.gate.kernel[...], sizes))
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

  def __call__(self, x: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """x [B, T, D] -> (y [B, T, D], (weights [B, T, k] float32, experts [B, T, k] int32): the router's
    choice)."""
    flat = x.reshape(-1, x.shape[-1])
    weights, experts = self.router(flat)
    y = self.experts(flat, weights, experts).reshape(x.shape)
    if hasattr(self, "shared"):
      y = y + self.shared(x)
    k = experts.shape[-1]
    return y, (weights.reshape(x.shape[:-1] + (k,)), experts.reshape(x.shape[:-1] + (k,)))


class Block(nnx.Module):
  """One pre-norm Transformer block; its feed-forward is a dense SwiGLU or, with `moe`, an `MoE`."""

  def __init__(self, config: ModelConfig, *, moe: bool = False, rngs: nnx.Rngs, dtype: Any):
    self.attn_norm = RMSNorm(config.d_model, config.norm_eps, dtype=dtype)
    self.attn = Attention(config, rngs=rngs, dtype=dtype)
    self.mlp_norm = RMSNorm(config.d_model, config.norm_eps, dtype=dtype)
    if moe:
      self.mlp = MoE(config, rngs=rngs, dtype=dtype)
    else:
      self.mlp = SwiGLU(config.d_model, config.mlp_hidden, rngs=rngs, dtype=dtype)

  def __call__(self, x, cos, sin, **attention_kwargs):
    """x [B, T, D] -> (x [B, T, D], incoming [B, Q, N, S] or None, (keys, values) [B, S, K, H], routing):
    routing is the MoE router's (weights [B, T, k] float32, experts [B, T, k] int32), or None in a dense
    block."""
    attn_out, incoming, kv = self.attn(self.attn_norm(x), cos, sin, **attention_kwargs)
    x = x + attn_out
    routing = None
    if isinstance(self.mlp, MoE):
      mlp_out, routing = self.mlp(self.mlp_norm(x))
    else:
      mlp_out = self.mlp(self.mlp_norm(x))
    return x + mlp_out, incoming, kv, routing


def _block_stack(config: ModelConfig, n: int, moe: bool, rngs: nnx.Rngs, dtype: Any) -> Block:
  """n blocks stored as one `Block` whose parameters have a leading [n] axis."""
  block_graph = nnx.graphdef(nnx.eval_shape(lambda: Block(config, moe=moe, rngs=nnx.Rngs(0), dtype=dtype)))
  keys = jax.random.split(rngs.params(), n)
  stacked = jax.vmap(lambda key: nnx.state(Block(config, moe=moe, rngs=nnx.Rngs(params=key), dtype=dtype)))(keys)
  return nnx.merge(block_graph, stacked)


class Transformer(nnx.Module):
  """Embedding, stacked blocks (`blocks`, and `dense_blocks` for an MoE model's leading dense layers), final
  norm, LM head."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype: Any = jnp.float32):
    self.config = config
    self.embed = nnx.Embed(config.vocab_size, config.d_model, param_dtype=dtype, embedding_init=_EMBED_INIT,
                           rngs=rngs)
    if config.first_k_dense:
      self.dense_blocks = _block_stack(config, config.first_k_dense, False, rngs, dtype)
    self.blocks = _block_stack(config, config.n_layers - config.first_k_dense, config.is_moe, rngs, dtype)
    self.final_norm = RMSNorm(config.d_model, config.norm_eps, dtype=dtype)
    if not config.tied_embeddings:
      self.lm_head = _linear(config.d_model, config.vocab_size, False, rngs, dtype)

  def __call__(self, tokens, positions, *, bias: AttentionBias, query_weights, stats_spec: StatsSpec,
               logits_window, logits_offset, impl, query_chunk, cache: KVCache | None,
               cache_offset, return_hidden: bool) -> ForwardOutput:
    """See `forward`. Statistics are computed only in the layers `stats_spec` asks for."""
    c = self.config
    x = self.embed(tokens)
    cos, sin = rope_tables(positions, c.rope_dim, c.rope_theta)
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
    layer_cache = None if cache is None else (cache.keys, cache.values)
    wanted = stats_spec.enabled
    slots = None
    if wanted and stats_spec.layers is not None:
      slot_of_layer = np.full((c.n_layers,), -1, np.int32)
      slot_of_layer[list(stats_spec.layers)] = np.arange(len(stats_spec.layers), dtype=np.int32)
      slots = jnp.asarray(slot_of_layer)

    def run_block(block, h, kv_cache, layer_biases, with_stats):
      h, incoming, (keys, values), routing = block(
          h, cos, sin, query_weights=query_weights, with_incoming=with_stats and stats_spec.incoming_attention,
          impl=impl, query_chunk=query_chunk, cache=kv_cache, cache_offset=cache_offset,
          zero_values=bias.zero_values, **shared, **layer_biases)
      stats = {}
      if with_stats and stats_spec.incoming_attention:
        stats["incoming_attention"] = incoming if stats_spec.per_head else jnp.mean(incoming, axis=2, keepdims=True)
      if with_stats and stats_spec.value_norms:
        stats["value_norms"] = jnp.linalg.norm(values.astype(jnp.float32), axis=-1).transpose(0, 2, 1)
      if with_stats and stats_spec.routing:
        stats.update(_routing_stats(c, routing, h.shape[:2], keys.shape[1], cache_offset))
      return h, (keys, values), stats

    def layer(block_graph, carry, xs):
      h, buffers = carry
      state, layer_biases, kv_cache, slot = xs
      block = nnx.merge(block_graph, state)
      if slots is None:
        h, kv, stats = run_block(block, h, kv_cache, layer_biases, wanted)
        return (h, buffers), {**stats, **({} if kv_cache is None else {"cache": kv})}

      def with_stats(h, buffers):
        h, kv, stats = run_block(block, h, kv_cache, layer_biases, True)
        return h, kv, {name: jax.lax.dynamic_update_index_in_dim(buffers[name], stats[name], slot, 0)
                       for name in buffers}

      def without_stats(h, buffers):
        h, kv, _ = run_block(block, h, kv_cache, layer_biases, False)
        return h, kv, buffers

      h, kv, buffers = jax.lax.cond(slot >= 0, with_stats, without_stats, h, buffers)
      return (h, buffers), ({} if kv_cache is None else {"cache": kv})

    buffers = {}
    if slots is not None:
      buffers = _stat_buffers(c, stats_spec, tokens.shape[0], x.shape[1] if cache is None else cache.keys.shape[2],
                              query_weights)
    layer_slots = jnp.zeros((c.n_layers,), jnp.int32) if slots is None else slots
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
      carry, ys = jax.lax.scan(functools.partial(layer, block_graph), carry, (block_state, *xs))
      stack_ys.append(ys)
    x, buffers = carry
    ys = stack_ys[0] if len(stack_ys) == 1 else jax.tree.map(lambda *a: jnp.concatenate(a), *stack_ys)
    new_cache = None if cache is None else KVCache(*ys.pop("cache"))
    stats = buffers if slots is not None else ys
    if logits_window is not None:
      start, stop = logits_window
      if isinstance(logits_offset, int) and logits_offset == 0:
        x = x[:, start:stop]
      else:
        x = jax.lax.dynamic_slice_in_dim(x, start + logits_offset, stop - start, axis=1)
    x = self.final_norm(x)
    head = self.embed.embedding[...].T if c.tied_embeddings else self.lm_head.kernel[...]
    logits, hidden = (None, x) if return_hidden else (_head_logits(x, head), None)
    return ForwardOutput(logits=logits, incoming_attention=stats.get("incoming_attention"),
                         value_norms=stats.get("value_norms"), routed_experts=stats.get("routed_experts"),
                         routing_weights=stats.get("routing_weights"), cache=new_cache, hidden=hidden)


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


def _head_logits(hidden: jax.Array, head: jax.Array) -> jax.Array:
  """[B, W, D] final-normed hidden states, head [D, V] -> float32 logits [B, W, V]."""
  return jnp.einsum("btd,dv->btv", hidden, head, preferred_element_type=jnp.float32)


def lm_head(params: Params, hidden: jax.Array, *, config: ModelConfig) -> jax.Array:
  """The LM head on final-normed hidden states [B, W, D] (`forward(..., return_hidden=True)`): float32
  logits [B, W, V], the same values `forward` returns for those positions."""
  head = params["embed"]["embedding"].T if config.tied_embeddings else params["lm_head"]["kernel"]
  return _head_logits(hidden, head)


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
  """The parameter tree as `jax.ShapeDtypeStruct`s, without allocating anything."""
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
    if ".mlp.experts." in name:
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


def _check_inputs(config, tokens, positions, bias, query_weights, stats_spec, logits_window, cache):
  if tokens.ndim != 2:
    raise ValueError(f"tokens must be [B, T] integer ids, got shape {tokens.shape}.")
  b, t = tokens.shape
  if positions is not None and positions.shape != (b, t):
    raise ValueError(f"positions must have the tokens' shape [B, T] = {(b, t)}, got {positions.shape}.")
  n_keys = t
  if cache is not None:
    expected = (config.n_layers, b, cache.keys.shape[2], config.n_kv_heads, config.head_dim)
    if cache.keys.shape != expected or cache.values.shape != expected:
      raise ValueError(f"cache keys and values must be [L, B, S, K, H] = {expected}, got {cache.keys.shape} "
                       f"and {cache.values.shape}.")
    n_keys = cache.keys.shape[2]
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
) -> ForwardOutput:
  """Pure forward pass of the Transformer described by `config`: full, windowed or KV-cached.

  Jit it with `config`, `stats_spec`, `logits_window`, `attention_impl`, `query_chunk` and `return_hidden`
  static.

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

  Returns:
    `ForwardOutput`: float32 logits [B, W, V], the requested statistics in the layout of
    `dlm_jax.stats.ForwardOutput` ([L', B, Q, N', S] incoming attention), and the updated cache (None
    without a cache).
  """
  _check_inputs(config, tokens, positions, bias, query_weights, stats_spec, logits_window, cache)
  if positions is None:
    start = 0 if cache is None else cache_offset
    positions = jnp.broadcast_to(start + jnp.arange(tokens.shape[1]), tokens.shape)
  model = nnx.merge(_graphdef(config), params)
  return model(tokens, positions, bias=bias, query_weights=query_weights, stats_spec=stats_spec,
               logits_window=logits_window, logits_offset=logits_offset, impl=attention_impl,
               query_chunk=query_chunk, cache=cache, cache_offset=0 if cache is None else cache_offset,
               return_hidden=return_hidden)
