"""The attention layer: q/k/v projections, QK norm, RoPE, the KV cache write and the attention core."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from dlm_jax.config import ModelConfig
from dlm_jax.instrument.site_hooks import SiteHooks, at
from dlm_jax.core.attention_bias import MASK_VALUE, AttentionBias
from dlm_jax.model.attention import attention
from dlm_jax.model.attention_inputs import AttentionComputation, Visibility
from dlm_jax.model.block_sparse_attention import block_sparse_attention
from dlm_jax.model.compute_subset import ComputeSubset, gather_rows, scatter_rows
from dlm_jax.model.primitives import RMSNorm, fused_linear, linear, rms_normalize
from dlm_jax.model.rope import apply_rope


class AttentionCall(NamedTuple):
  """What one attention layer is given besides its input and cache (shared by the layers of a call, with each
  layer's own biases and key subset set by the model).

  impl, query_chunk: the attention path (`dlm_jax.model.attention`); query_weights: [B, Q, T] or None;
  with_incoming: also return the incoming attention; pairwise_bias: [B|1, N|1, T|1, S] or None; key_bias:
  [B|1, N|1, S] or None; zero_values: [B|1, S] bool or None, key positions that contribute a zero value vector
  (their keys, hence their attention weights, unchanged; the returned values carry the zeros too);
  cache_offset: sequence index of the first query with a cache; structure_key_bias: [1, 1, S] or None, added to
  key_bias (a decoder call's visible key range); mode: "write" (the cache, if any, is written) or "decode" (a
  DiffusionGemma decoder call: read, never written, no causal mask, no sliding window); subset: a
  `ComputeSubset` (with a cache: the T queries sit at subset.queries [B, T], their keys and values written
  there); key_index: [B, m] this layer's row of subset.keys (the queries read only those cached positions and
  their own; the incoming attention is still over the S positions), or None; key_blocks: this layer's
  `KeyBlocks` (subset.key_blocks at the layer: block-sparse attention over every position), or None;
  with_rows: also return the head-mean attention rows of the queries over the S positions (`attention`'s
  with_rows; not with key_blocks).
  """

  impl: str
  query_chunk: int
  query_weights: Any = None
  with_incoming: bool = False
  pairwise_bias: Any = None
  key_bias: Any = None
  zero_values: Any = None
  cache_offset: Any = 0
  structure_key_bias: Any = None
  mode: str = "write"
  subset: Any = None
  key_index: Any = None
  key_blocks: Any = None
  with_rows: bool = False


class AttentionReadings(NamedTuple):
  """What one attention layer hands the statistics besides its output: incoming [B, Q, N, S] or None; keys,
  values [B, S, K, H] (after RoPE, the cache written; a decoder call's: the cache as given); queries
  [B, T, N, H] after RoPE; rows [B, T, S] the head-mean attention rows (call.with_rows) or None."""

  incoming: jax.Array | None
  keys: jax.Array
  values: jax.Array
  queries: jax.Array
  rows: jax.Array | None = None


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
    self.q = linear(c.d_model, c.n_heads * h, c.qkv_bias, rngs, dtype)
    self.k = linear(c.d_model, kv * h, c.qkv_bias, rngs, dtype)
    if not self.k_eq_v:
      self.v = linear(c.d_model, kv * h, c.qkv_bias, rngs, dtype)
    self.o = linear(c.n_heads * h, c.d_model, False, rngs, dtype)
    if c.qk_norm:
      self.q_norm = RMSNorm(h, c.norm_eps, dtype=dtype, fp32_weight=c.norm_fp32_weight)
      self.k_norm = RMSNorm(h, c.norm_eps, dtype=dtype, fp32_weight=c.norm_fp32_weight)

  def __call__(self, x, cos, sin, call: AttentionCall, cache=None, hooks: SiteHooks | None = None):
    """x [B, T, D] -> (out [B, T, D], `AttentionReadings`: incoming [B, Q, N, S] or None, keys and values
    [B, S, K, H], the queries [B, T, N, H] after RoPE).

    call: the layer's `AttentionCall`. With `cache` = (keys, values) [B, S, K, H], this call's keys and values
    are written at sequence positions call.cache_offset..+T-1 (mode "write") and the queries attend to the
    whole cache (S keys); a "decode" call attends as if written, but the returned (keys, values) are the cache
    as given. hooks: the layer's `SiteHooks` (attn.hook_q / k / v after the projection and QK norm, before
    RoPE; attn.hook_z before the output projection; attn.hook_pattern), or None.
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
    q, k, v = at(hooks, "attn.hook_q", q), at(hooks, "attn.hook_k", k), at(hooks, "attn.hook_v", v)
    q = apply_rope(q, cos, sin, fp32=c.rope_fp32)
    k = apply_rope(k, cos, sin, fp32=c.rope_fp32)
    given_cache = cache
    subset = call.subset
    if subset is not None and subset.queries is not None:
      k, v = scatter_rows(cache[0], subset.queries, k), scatter_rows(cache[1], subset.queries, v)
    elif cache is not None:
      zero = jnp.zeros((), jnp.int32)
      start = (zero, jnp.asarray(call.cache_offset, jnp.int32), zero, zero)
      k = jax.lax.dynamic_update_slice(cache[0], k.astype(cache[0].dtype), start)
      v = jax.lax.dynamic_update_slice(cache[1], v.astype(cache[1].dtype), start)
    if call.zero_values is not None:
      v = jnp.where(call.zero_values[:, :, None, None], jnp.zeros((), v.dtype), v)
    key_bias = call.key_bias
    if call.structure_key_bias is not None:
      key_bias = call.structure_key_bias if key_bias is None else jnp.maximum(key_bias + call.structure_key_bias,
                                                                              MASK_VALUE)
    decoder = call.mode == "decode"
    window = c.sliding_window if self.kind == "s" and c.layer_pattern is not None and not decoder else None
    scale = 1.0 / math.sqrt(h) if c.attention_scale is None else c.attention_scale
    common = dict(scale=scale, visibility=Visibility(causal=c.causal and not decoder, block_size=c.attention_block_size,
                                                     window=window, query_offset=call.cache_offset),
                  bias=AttentionBias(pairwise=call.pairwise_bias, keys=key_bias))
    computation = AttentionComputation(query_weights=call.query_weights, with_incoming=call.with_incoming,
                                       with_rows=call.with_rows, impl=call.impl, query_chunk=call.query_chunk)
    rows = None
    if subset is not None and call.key_index is not None:
      out, incoming, rows = self._key_subset(q, k, v, call.key_index, subset, computation, common)
    elif call.key_blocks is not None:
      out, incoming = block_sparse_attention(q, k, v, call.key_blocks, scale=scale, bias=common["bias"],
                                             computation=computation)
    elif call.with_rows:
      out, incoming, rows = attention(q, k, v, computation=computation, **common)
    else:
      out, incoming = attention(q, k, v, computation=computation, **common)
    if hooks is not None and hooks.wants("attn.hook_pattern"):
      hooks.pattern(lambda weights: self._probabilities(q, k, v, weights, call, subset, common, computation), t, b)
    out = at(hooks, "attn.hook_z", out)
    if decoder:
      k, v = given_cache
    return self.o(out.reshape(b, t, c.n_heads * h)), AttentionReadings(incoming, k, v, q, rows)

  def _probabilities(self, q, k, v, weights, call: AttentionCall, subset, common, computation) -> jax.Array:
    """[B, P, N, S] the attention probabilities of the query weights [B, P, T] (one-hot: chosen queries) over
    the keys this call's queries read: the layer's key subset, its kept key blocks, or every key."""
    computation = AttentionComputation(query_weights=weights, with_incoming=True, impl=computation.impl,
                                       query_chunk=computation.query_chunk)
    if subset is not None and call.key_index is not None:
      return self._key_subset(q, k, v, call.key_index, subset, computation, common)[1]
    if call.key_blocks is not None:
      return block_sparse_attention(q, k, v, call.key_blocks, scale=common["scale"], bias=common["bias"],
                                    computation=computation)[1]
    return attention(q, k, v, computation=computation, **common)[1]

  @staticmethod
  def _key_subset(q, k, v, key_index, subset, computation: AttentionComputation, common):
    """Attention of the queries over the cached positions key_index [B, m] and their own (subset.queries):
    the keys are gathered (padded entries masked), the key bias with them, and the incoming attention (and
    the rows) are scattered back onto the S positions. Block-causal attention masks each gathered key whose
    block is after its query's (`Visibility.block_size` applied to the positions, not to the gathered order).
    Returns (out, incoming [B, Q, N, S] or None, rows [B, T, S] or None)."""
    n_seq = k.shape[1]
    positions = jnp.concatenate([key_index, subset.queries], axis=1)  # [B, m + T]
    padded = jnp.where(positions >= n_seq, MASK_VALUE, 0.0).astype(jnp.float32)[:, None, :]
    at = jnp.minimum(positions, n_seq - 1)
    key_bias, pairwise = common["bias"].keys, common["bias"].pairwise
    key_bias = padded if key_bias is None else jnp.maximum(
        jnp.take_along_axis(jnp.broadcast_to(key_bias, (at.shape[0], key_bias.shape[1], n_seq)), at[:, None, :],
                            axis=2) + padded, MASK_VALUE)
    if pairwise is not None:
      pairwise = jnp.broadcast_to(pairwise, (at.shape[0], *pairwise.shape[1:]))
      pairwise = jnp.take_along_axis(pairwise, at[:, None, None, :], axis=3)
    block_size = common["visibility"].block_size
    if block_size is not None:
      later = at[:, None, None, :] // block_size > subset.queries[:, None, :, None] // block_size
      blocked = jnp.where(later, MASK_VALUE, 0.0).astype(jnp.float32)  # [B, 1, T, m + T]
      pairwise = blocked if pairwise is None else jnp.maximum(pairwise + blocked, MASK_VALUE)
      common = {**common, "visibility": Visibility()}
    out, incoming, *rest = attention(q, gather_rows(k, positions), gather_rows(v, positions),
                                     computation=computation,
                                     **{**common, "bias": AttentionBias(pairwise=pairwise, keys=key_bias)})
    batch_rows = jnp.arange(positions.shape[0])[:, None]
    if incoming is not None:
      moved = jnp.moveaxis(incoming, -1, 1)  # [B, m + T, Q, N]
      incoming = jnp.moveaxis(jnp.zeros((positions.shape[0], n_seq, *moved.shape[2:]), incoming.dtype)
                              .at[batch_rows, positions].add(moved, mode="drop"), 1, -1)
    rows = None
    if computation.with_rows:
      moved = jnp.moveaxis(rest[0], -1, 1)  # [B, m + T, T]
      rows = jnp.moveaxis(jnp.zeros((positions.shape[0], n_seq, moved.shape[2]), moved.dtype)
                          .at[batch_rows, positions].add(moved, mode="drop"), 1, -1)
    return out, incoming, rows

  def project_qkv(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [B, T, D] -> q [B, T, N·H], k, v [B, T, K·H]: three matmuls, or one with
    `ModelConfig.fused_projections`. With K = V (global DiffusionGemma layers) v is k's projection."""
    if self.k_eq_v:
      k = self.k(x)
      return self.q(x), k, k
    if self.config.fused_projections:
      return fused_linear(x, (self.q, self.k, self.v))
    return self.q(x), self.k(x), self.v(x)
