"""A layer-range refresh inside one forward (Elastic-Cache, `dlm_jax.policy.elastic_cache`): the layers below a
row's refresh start run only the call's queries (reading the other positions' cached keys and values, as a
`ComputeSubset` call does); from the first layer whose attention drifted on, every position of that row is
recomputed and its caches replaced.

The start is decided during the forward: after layer l, a row whose tracked tokens' attention rows moved
(cosine similarity over heads, averaged over the tracked tokens and the S keys, below gamma;
`dlm_jax.policy.elastic_cache.drift_similarity`) refreshes from layer l + 1. Layer l + 1 needs every
position's input, so the refresh carries each layer's input as last computed (`LayerRefresh.hidden`
[L, B, S, D], the official code's per-layer `x_cache`), with the call's fresh rows scattered in.

Static shapes, no host round trip: one `lax.scan` over the layers carries the queries' hidden states
[B, T, D], the full-width hidden states [B, S, D] of the refreshed rows and each row's start [B]; each layer
is a `lax.cond` between the subset layer (no row refreshes yet) and the full layer (some row does). Inside a
full layer a row that has not triggered keeps its subset meaning: its input is its cached layer input with
its queries' fresh rows, only its queries' outputs go on, and its cached inputs at the other positions stay;
its keys and values at the other positions are recomputed from those cached inputs (the cached values, up to
float rounding: in the batch-invariant mode every row runs alone and the question does not arise).

The tracked tokens' previous attention rows softmax(q_prev · K_prevᵀ/√H) use q_prev recomputed from the
cached layer input at their positions (the official code keeps a query cache written together with the input
cache, so the rows are the same) and the key cache before the call; the current rows use the call's input
and keys. Keys the call's shared key bias removes (key padding) are left out of both rows and of the mean (the
official code has no padding). Dense layer stacks only (one run of blocks: LLaDA, MMaDA, Dream); no key subsets, no
pairwise bias with query rows, no layer subset of statistics.

Hooks: a subset layer runs them at the queries; a full layer at every position (edits act wherever the layer
computes, so the keys and values it rewrites carry them as when last computed), keeping the captures of the
positions it computes for each row (every position from the row's start on, its queries below it) and zeros
elsewhere. The drift test reads the layer's queries without the edits.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx, struct

from dlm_jax.core.attention_bias import MASK_VALUE
from dlm_jax.model.cache import KVCache
from dlm_jax.model.compute_subset import gather_rows, scatter_rows
from dlm_jax.model.rope import apply_rope
from dlm_jax.policy.elastic_cache import attention_rows, drift_similarity


@struct.dataclass
class LayerRefresh:
  """The layer refresh of a `ComputeSubset` call (module docstring).

  hidden: [L, B, S, D] each layer's input at every position as last computed; tracked: [B, R] int32 positions
  whose attention drift is tested (padded with S); start: [B] int32 the first layer recomputed for every
  position before any drift (0: every layer; L: none); gamma: the drift threshold (static); tokens,
  positions: [B, S] the whole sequence and its RoPE positions (set by the caller that gathers the queries).
  """

  hidden: jax.Array
  tracked: jax.Array
  start: jax.Array
  gamma: float = struct.field(pytree_node=False)
  tokens: jax.Array | None = None
  positions: jax.Array | None = None


@struct.dataclass
class RefreshResult:
  """What a refresh call leaves: hidden [L, B, S, D], the layer inputs to cache; start [B] int32, the first
  layer recomputed for every position (L: none); similarity [L, B] float32, each layer's drift similarity
  (1 where no tracked token)."""

  hidden: jax.Array
  start: jax.Array
  similarity: jax.Array


def check(config, call, per_layer: dict) -> None:
  """Refuses, in one line, what the refresh does not run with."""
  if config.layer_pattern is not None or config.first_k_dense:
    raise ValueError(f"a layer refresh runs a model with one stack of alike layers; {config.name} has several.")
  if call.slots is not None or "key_index" in per_layer:
    raise ValueError("a layer refresh runs without a layer subset of statistics or key subsets.")
  pairwise = [call.attention.pairwise_bias, per_layer.get("pairwise_bias")]
  if any(p is not None and p.shape[-2] != 1 for p in pairwise):
    raise ValueError("a layer refresh runs without a pairwise attention bias that varies by query (padded prompts "
                     "with padding='outer'); use key padding.")


def _queries(block, config, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """The layer's post-RoPE queries [B, R, N, H] of its inputs x [B, R, D] at RoPE tables [B, R, H]."""
  attn = block.attn
  q = attn.project_qkv(block.attn_norm(x))[0].reshape(x.shape[0], x.shape[1], config.n_heads, attn.head_dim)
  if config.qk_norm:
    q = attn.q_norm(q)
  return apply_rope(q, cos, sin, fp32=config.rope_fp32)


def _valid_keys(key_bias: jax.Array | None, batch: int, n_seq: int) -> jax.Array | None:
  """[B, S] bool: the keys the call's shared key bias [B|1, N|1, S] leaves to every head (padding removes the
  others), or None without one. The drift rows and their mean leave the removed keys out."""
  if key_bias is None:
    return None
  return jnp.broadcast_to(jnp.all(key_bias > MASK_VALUE / 2, axis=1), (batch, n_seq))


def _spread(weights: jax.Array | None, queries: jax.Array, n_seq: int) -> jax.Array | None:
  """Query-group weights [B, Q, T] of the queries at positions queries [B, T] -> [B, Q, S] (0 elsewhere)."""
  if weights is None:
    return None
  placed = scatter_rows(jnp.zeros((weights.shape[0], n_seq, weights.shape[1]), weights.dtype), queries,
                        jnp.swapaxes(weights, 1, 2))
  return jnp.swapaxes(placed, 1, 2)


def run_layers(model, call, x: jax.Array, per_layer: dict, kind_caches: dict, run_layer,
               capture_buffers: dict) -> tuple:
  """Every layer under `call.attention.subset.refresh` (module docstring). model: the `Transformer`; call: its
  `_LayerCall` for the queries; x: the queries' embeddings [B, T, D]; per_layer: the per-layer biases;
  kind_caches: {"s": (keys, values)}; run_layer: the transformer's one-layer function; capture_buffers: the
  hooks' zero capture buffers ({} without hooks). Returns (h [B, T, D], per-layer statistics, the new `KVCache`,
  `RefreshResult`, the capture buffers)."""
  config = model.config
  check(config, call, per_layer)
  subset = call.attention.subset
  refresh, queries = subset.refresh, subset.queries
  keys, values = kind_caches["s"]
  n_seq = keys.shape[2]
  is_query = scatter_rows(jnp.zeros(refresh.tokens.shape, bool), queries, queries < n_seq)
  full_sites = None if call.sites is None else dataclasses.replace(call.sites, index=None)
  full_call = dataclasses.replace(
      call, tables=model._rope_tables(refresh.positions),
      attention=call.attention._replace(subset=None, cache_offset=0,
                                        query_weights=_spread(call.attention.query_weights, queries, n_seq)))
  tracked_cos, tracked_sin = model._rope_tables(gather_rows(refresh.positions, refresh.tracked))["s"]
  tracked_valid = refresh.tracked < n_seq
  key_valid = _valid_keys(call.attention.key_bias, queries.shape[0], n_seq)
  with_stats = call.stats_spec.enabled
  block_graph, block_state = nnx.split(model.blocks)

  def layer_step(carry, xs):
    h, h_full, start, buffers = carry
    state, layer_biases, kv, x_cache, layer = xs
    block = nnx.merge(block_graph, state)

    def subset_layer(_):
      out, new_kv, stats, captured = run_layer(call, "s", block, h, kv, layer_biases, with_stats, layer, buffers)
      return out, h_full, new_kv, scatter_rows(x_cache, queries, h), stats, captured

    def full_layer(_):
      carried = (start < layer) | (start == 0)  # rows whose full-width input is the previous full layer's output
      x_in = jnp.where(carried[:, None, None], h_full, scatter_rows(x_cache, queries, h))
      sites = None if full_sites is None else dataclasses.replace(full_sites, kept=(start <= layer)[:, None] | is_query)
      out, new_kv, stats, captured = run_layer(dataclasses.replace(full_call, sites=sites), "s", block, x_in, kv,
                                               layer_biases, with_stats, layer, buffers)
      return gather_rows(out, queries), out, new_kv, x_in, stats, captured

    h, h_full, new_kv, x_in, stats, captured = jax.lax.cond(jnp.any(start <= layer), full_layer, subset_layer, None)
    if call.sites is not None:
      buffers = call.sites.write("s", layer, buffers, captured)
    before = attention_rows(_queries(block, config, gather_rows(x_cache, refresh.tracked), tracked_cos,
                                     tracked_sin), kv[0], key_valid)
    now = attention_rows(_queries(block, config, gather_rows(x_in, refresh.tracked), tracked_cos, tracked_sin),
                         new_kv[0], key_valid)
    similarity = drift_similarity(before, now, tracked_valid, key_valid)
    start = jnp.where((start > layer) & (similarity < refresh.gamma), layer + 1, start).astype(jnp.int32)
    return (h, h_full, start, buffers), {"cache": new_kv, "hidden": x_in, "similarity": similarity, "stats": stats}

  h_full = model._embed(refresh.tokens, None, None if full_sites is None else full_sites.model_sites()).astype(x.dtype)
  xs = (block_state, per_layer, (keys, values), refresh.hidden.astype(x.dtype),
        jnp.arange(config.n_layers, dtype=jnp.int32))
  (h, _, start, capture_buffers), ys = jax.lax.scan(
      layer_step, (x, h_full, refresh.start.astype(jnp.int32), capture_buffers), xs)
  result = RefreshResult(hidden=ys["hidden"], start=start, similarity=ys["similarity"])
  return h, ys["stats"], KVCache(*ys["cache"]), result, capture_buffers
