"""Per-layer reuse of attention and feed-forward outputs (dLLM-Cache, `dlm_jax.policy.dllm_cache`): a model call
whose every position runs through every layer while each layer recomputes its attention and feed-forward
sub-blocks at a subset of positions chosen inside the forward, at that layer.

A layer with input h [B, S, D] keeps four caches: its keys and values [B, S, K, H] (the KV cache; keys after
RoPE) and its attention output A and feed-forward output F [B, S, D] (after their output projections). A call
refreshes the prompt [0, P) and / or the response [P, S) (static, `LayerReuse`). At a layer whose response is
not refreshed and count > 0 it first computes the response's values V = v(attn_norm(h[:, P:])) [B, G, K, H],
replaces the cached response values by them, and adds the `count` response positions whose fresh and cached
values have the lowest cosine similarity (`dlm_jax.policy.dllm_cache.refresh_positions`). At the R recomputed
positions q [B, R] (refreshed regions, then the adaptive ones): Q, K, V of attn_norm(h[q]) with the existing
`Attention` (K and V written into the cache at q), attention over all S cached keys, A[q] replaced; h_mid =
h + A; F[q] = mlp(mlp_norm(h_mid[q])); h_next = h_mid + F. Every other position adds its cached A and F: its
residual stream moves with its fresh input, by cached deltas. A layer that recomputes nothing runs one padded
query (index S: read at S − 1, written nowhere, no weight in the statistics).

Hooks: the residual-stream sites (hook_resid_pre, hook_resid_mid, hook_resid_post) see every position, the
sites inside attention and the feed-forward (attn.*, hook_attn_out, mlp.hook_post, hook_mlp_out) the R
recomputed positions only (their captures hold zeros at the reused ones; an edit there acts where the layer
recomputes, and a reused output is the one last computed, with that call's edits). The adaptive values V of the
response pass attn.hook_v's edits (not its captures).

Static shapes: R is a Python int from the case (P if the prompt refreshes, G if the response does, plus count
adaptive positions). Dense bidirectional blocks only (LLaDA, MMaDA, Dream): no MoE, sandwich norms, layer
scalar or layer pattern (`check_config`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct

from dlm_jax.config import ModelConfig
from dlm_jax.instrument.site_hooks import at
from dlm_jax.instrument.stats import STATISTICS, LayerValues
from dlm_jax.model.cache import KVCache
from dlm_jax.model.compute_subset import ComputeSubset, gather_rows, scatter_rows
from dlm_jax.model.primitives import rms_normalize
from dlm_jax.policy.dllm_cache import refresh_positions, value_similarity


@struct.dataclass
class ReuseCache:
  """Everything a reuse call reads and rewrites. kv: the `KVCache` [L, B, S, K, H]; attn, ffn: [L, B, S, D]
  each layer's attention and feed-forward outputs as last computed; recomputed: [L, B, S] bool, the positions
  each layer recomputed at the call that wrote this cache."""

  kv: KVCache
  attn: jax.Array
  ffn: jax.Array
  recomputed: jax.Array

  @classmethod
  def zeros(cls, config: ModelConfig, batch: int, length: int, dtype: Any = jnp.float32) -> ReuseCache:
    features = jnp.zeros((config.n_layers, batch, length, config.d_model), dtype)
    return cls(kv=KVCache.zeros(config, batch, length, dtype), attn=features, ffn=features,
               recomputed=jnp.zeros((config.n_layers, batch, length), bool))


@struct.dataclass
class LayerReuse:
  """`ComputeSubset.reuse`: what a reuse call computes (module docstring).

  attn, ffn: [L, B, S, D] the cached attention and feed-forward outputs (`ReuseCache`); prompt_length: P;
  count: adaptive response positions per layer whose response is not refreshed; refresh_prompt, refresh_gen:
  the regions this call recomputes at every layer after the first; first_layer_full: layer 0 recomputes
  everything (dLLM-Cache's official quirk) instead of following the call's regions.
  """

  attn: jax.Array
  ffn: jax.Array
  prompt_length: int = struct.field(pytree_node=False)
  count: int = struct.field(pytree_node=False)
  refresh_prompt: bool = struct.field(pytree_node=False)
  refresh_gen: bool = struct.field(pytree_node=False)
  first_layer_full: bool = struct.field(pytree_node=False)


@dataclasses.dataclass(frozen=True)
class _Plan:
  """One layer's static plan: fixed recomputed positions [lo, hi) ranges and whether it adds adaptive ones."""

  ranges: tuple[tuple[int, int], ...]
  adaptive: bool


def _plans(reuse: LayerReuse, n_layers: int, n_seq: int) -> list[tuple[int, int, _Plan]]:
  """(start, stop, plan) runs of layers sharing a plan, in order."""
  p = reuse.prompt_length
  ranges = (((0, p),) if reuse.refresh_prompt else ()) + (((p, n_seq),) if reuse.refresh_gen else ())
  call = _Plan(tuple(r for r in ranges if r[1] > r[0]), not reuse.refresh_gen and reuse.count > 0)
  full = _Plan(((0, n_seq),), False)
  if reuse.first_layer_full and call != full:
    return [(0, 1, full)] + ([(1, n_layers, call)] if n_layers > 1 else [])
  return [(0, n_layers, call)]


def check_config(config: ModelConfig) -> str | None:
  """Why a reuse call cannot run on `config` (one line), or None."""
  if (config.causal or config.attention_block_size is not None or config.layer_pattern is not None
      or config.is_moe or config.first_k_dense or config.sandwich_norms or config.layer_scalar
      or config.moe_with_dense_mlp):
    return (f"per-layer reuse runs dense bidirectional blocks (LLaDA, MMaDA, Dream); {config.name} is causal, "
            "block-causal, mixture-of-experts or has a layer pattern, sandwich norms or a layer scalar.")
  return None


def _fresh_values(attention, x: jax.Array, config: ModelConfig) -> jax.Array:
  """The attention layer's values of normed inputs x [B, G, D]: [B, G, K, H] (v projection, v_norm)."""
  b, g, _ = x.shape
  v = attention.project_qkv(x)[2] if config.fused_projections else attention.v(x)
  v = v.reshape(b, g, attention.n_kv_heads, attention.head_dim)
  return rms_normalize(v, config.norm_eps) if config.v_norm else v


def _pairwise_rows(pairwise, queries: jax.Array):
  """A pairwise bias [B|1, N|1, S|1, S] at the query rows queries [B, R] (unchanged when it has one row)."""
  if pairwise is None or pairwise.shape[-2] == 1:
    return pairwise
  full = jnp.broadcast_to(pairwise, (queries.shape[0], *pairwise.shape[1:]))
  index = jnp.minimum(queries, pairwise.shape[-1] - 1)[:, None, :, None]
  return jnp.take_along_axis(full, index, axis=2)


def _site_hooks(call, layer, buffers: dict, index: jax.Array | None):
  """The layer's `SiteHooks` at every position (index None) or at the positions index [B, R]; None without
  hooks."""
  if call.sites is None:
    return None
  return dataclasses.replace(call.sites, index=index).layer_sites("s", layer, buffers)


def _layer(call, reuse: LayerReuse, plan: _Plan, block, h, keys, values, attn, ffn, biases, with_stats: bool,
           layer=None, buffers=None):
  """One layer under `plan` (module docstring): (h, keys, values, attn, ffn, recomputed [B, S] bool, stats,
  {capture index: this layer's captured value}); layer: its index (traced), buffers: the capture buffers so
  far (hooks only)."""
  c = call.config
  b, s, _ = h.shape
  p = reuse.prompt_length
  every = _site_hooks(call, layer, buffers, None)
  h = at(every, "hook_resid_pre", h)
  parts = [jnp.broadcast_to(jnp.arange(lo, hi, dtype=jnp.int32)[None], (b, hi - lo)) for lo, hi in plan.ranges]
  if plan.adaptive:
    fresh = _fresh_values(block.attn, block.attn_norm(h[:, p:]), c)
    response = jnp.broadcast_to(jnp.arange(p, s, dtype=jnp.int32)[None], (b, s - p))
    fresh = at(_site_hooks(call, layer, buffers, response), "attn.hook_v", fresh)
    parts.append(refresh_positions(value_similarity(fresh, values[:, p:]), reuse.count) + p)
    values = values.at[:, p:].set(fresh.astype(values.dtype))
  queries = jnp.concatenate(parts, axis=1) if parts else jnp.full((b, 1), s, jnp.int32)
  real = queries < s
  weights = call.attention.query_weights
  if weights is not None:
    weights = jnp.swapaxes(gather_rows(jnp.swapaxes(weights, 1, 2), queries), 1, 2) * real[:, None, :]
  cos, sin = call.tables["s"]
  pairwise = biases.get("pairwise_bias", call.attention.pairwise_bias)
  attention = call.attention._replace(with_incoming=with_stats and call.stats_spec.attention, query_weights=weights,
                                      subset=ComputeSubset(queries), key_index=None,
                                      **{**biases, "pairwise_bias": _pairwise_rows(pairwise, queries)})
  recomputing = _site_hooks(call, layer, buffers, queries)
  out, readings = block.attn(block.attn_norm(gather_rows(h, queries)), gather_rows(cos, queries),
                             gather_rows(sin, queries), attention, (keys, values), recomputing)
  attn = scatter_rows(attn, queries, at(recomputing, "hook_attn_out", out))
  h = at(every, "hook_resid_mid", h + attn)
  ffn = scatter_rows(ffn, queries, at(recomputing, "hook_mlp_out",
                                      block.mlp(block.mlp_norm(gather_rows(h, queries)), recomputing)))
  h = at(every, "hook_resid_post", h + ffn)
  recomputed = scatter_rows(jnp.zeros((b, s), bool), queries, real)
  stats = {}
  if with_stats:
    spec = call.stats_spec
    layer_values = LayerValues(incoming=readings.incoming, keys=readings.keys, values=readings.values, hidden=h,
                               queries=readings.queries, query_weights=weights, routing=None, query_offset=0,
                               n_queries=queries.shape[1], per_head=spec.per_head, k=c.experts_per_token)
    stats = {name: STATISTICS[name].compute(layer_values) for name in spec.names}
  captured = {} if every is None else {**every.captured, **recomputing.captured}
  return h, readings.keys, readings.values, attn, ffn, recomputed, stats, captured


def run_layers(model, call, reuse: LayerReuse, x: jax.Array, per_layer: dict, cache: KVCache,
               capture_buffers: dict):
  """Every layer of `model` (a `Transformer` with one dense block stack) under `reuse`, one `lax.scan` per run
  of layers sharing a plan. call: the forward's layer call (tables, attention call, statistics spec, hooks);
  per_layer: the per-layer biases [L, ...]; cache: the `KVCache`; capture_buffers: the hooks' zero capture
  buffers ({} without hooks). Returns (x [B, S, D], the per-layer statistics stacked in layer order, the new
  `ReuseCache`, the capture buffers)."""
  block_graph, block_state = nnx.split(model.blocks)
  n_layers, n_seq = call.config.n_layers, x.shape[1]
  with_stats = call.stats_spec.enabled
  take = lambda tree, start, stop: jax.tree.map(lambda a: a[start:stop], tree)  # noqa: E731
  outputs = []
  for start, stop, plan in _plans(reuse, n_layers, n_seq):

    def body(carry, xs, plan=plan):
      h, buffers = carry
      state, biases, keys, values, attn, ffn, layer = xs
      h, *rest, stats, captured = _layer(call, reuse, plan, nnx.merge(block_graph, state), h, keys, values, attn,
                                         ffn, biases, with_stats, layer, buffers)
      if call.sites is not None:
        buffers = call.sites.write("s", layer, buffers, captured)
      return (h, buffers), (*rest, stats)

    xs = take((block_state, per_layer, cache.keys, cache.values, reuse.attn, reuse.ffn,
               jnp.arange(n_layers, dtype=jnp.int32)), start, stop)
    (x, capture_buffers), ys = jax.lax.scan(body, (x, capture_buffers), xs)
    outputs.append(ys)
  keys, values, attn, ffn, recomputed, stats = (outputs[0] if len(outputs) == 1 else
                                                jax.tree.map(lambda *a: jnp.concatenate(a), *outputs))
  return x, stats, ReuseCache(kv=KVCache(keys, values), attn=attn, ffn=ffn, recomputed=recomputed), capture_buffers

