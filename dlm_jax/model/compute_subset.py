"""A call that computes part of the sequence (a compute policy's decision, `dlm_jax.policy`): which query
positions run through the layers and which cached positions each layer's queries read.

The model only applies it: the queries' keys and values are scattered into the KV cache at their positions,
attention reads the cache (all S positions, or each layer's key subset and the queries' own positions), and
statistics stay in sequence coordinates. Index arrays are padded with S (an entry that reads position S − 1,
writes nothing and is hidden as a key). Valid for bidirectional attention, and for block-causal attention with
a key subset (each gathered key is masked by its block against its query's: block diffusion under Sparse-dLLM);
not for causal or sliding-window patterns, nor block-causal without a key subset (their masks are built from
contiguous query indices).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from dlm_jax.model.block_sparse_attention import KeyBlocks


@struct.dataclass
class ComputeSubset:
  """queries: [B, T] int32 sequence positions of the call's T queries (ascending, padded with S), or None with
  key_blocks (every position is a query, no cache is read); keys: [L, B, m] int32 cached positions each layer
  reads besides the queries' own (disjoint from them, padded with S), or None for all S; refresh: a
  `dlm_jax.model.layer_refresh.LayerRefresh` (keys None), or None: the layers from each row's first drifted one
  on recompute every position; key_blocks: a `KeyBlocks` ([L, B, N, nQb, m]: each layer's, head's and query
  block's kept key blocks, SparseD) or None; reuse: a `dlm_jax.model.reuse_layers.LayerReuse` (queries then every
  position, keys None): each layer recomputes its attention and feed-forward outputs at positions it chooses and
  reuses the cached ones elsewhere (the forward returns a `ReuseCache`), or None; full: [B] bool or None, with
  key_blocks only: the call is the full one instead (every key, no subset) when any row's entry is true — a
  `lax.cond` over the batch, so run one row at a time (`dlm_jax.sampling.row_by_row.forward_rows`) each row
  takes its own branch; buckets: static ascending query-row counts, the last T, or (): the call runs only the
  first queries of the smallest bucket holding every row's real ones (`lax.switch`, `dlm_jax.model.query_buckets`;
  run one row at a time, each row at its own bucket), its other rows zeros."""

  queries: jax.Array | None
  keys: jax.Array | None = None
  refresh: Any = None
  key_blocks: KeyBlocks | None = None
  reuse: Any = None
  full: jax.Array | None = None
  buckets: tuple[int, ...] = struct.field(pytree_node=False, default=())


def gather_rows(x: jax.Array, index: jax.Array) -> jax.Array:
  """x [B, S, ...] at index [B, n] -> [B, n, ...]; padded entries (index S) read position S − 1."""
  index = jnp.minimum(index, x.shape[1] - 1)
  return jnp.take_along_axis(x, index.reshape(index.shape + (1,) * (x.ndim - 2)), axis=1)


def scatter_rows(base: jax.Array, index: jax.Array, values: jax.Array) -> jax.Array:
  """base [B, S, ...] with values [B, n, ...] written at index [B, n]; padded entries (index S) write nothing.
  One scatter per row (`jax.vmap`: the batch is the scatter's batching dimension), so a batch sharded over a
  mesh scatters on each device without gathering the other devices' indices."""
  return jax.vmap(lambda b, i, v: b.at[i].set(v.astype(b.dtype), mode="drop"))(base, index, values)
