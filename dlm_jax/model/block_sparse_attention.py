"""Block-sparse attention: each head's query block reads a fixed number of kept key blocks, and only those.

SparseD's mechanism (`dlm_jax.policy.sparsed_policy`). The sequence is cut into blocks of `block_size`
positions from position 0; a last block shorter than block_size holds the remaining positions (the official
FlexAttention mask is token-level, `mask[b, h, q // block_size, k // block_size]`, so a partial block is simply
cropped). Per head n and query block i, `KeyBlocks.index[b, n, i]` lists m kept key blocks (ascending, padded
with nKb = ceil(S / block_size)); the queries of block i attend over the m·block_size keys of those blocks,
padded slots and positions past S hidden. Shapes are static: the kept count m is the rule's maximum, so the
compiled program computes QKᵀ and PV over m·block_size keys per query instead of S
(`dlm_jax.policy.cost.block_sparse_flops`).

The result equals dense attention with the additive mask that hides every key outside the kept blocks (a
masked key gets exactly zero probability there, `dlm_jax.model.attention`), up to float rounding; the
incoming attention is scattered back onto the S key positions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from dlm_jax.core.attention_bias import MASK_VALUE, NO_BIAS, AttentionBias
from dlm_jax.core.old_keywords import fold_old_keywords
from dlm_jax.model.attention_inputs import ATTENTION_MOVES, DEFAULT_COMPUTATION, AttentionComputation

_MOVES = {name: move for name, move in ATTENTION_MOVES.items()
          if name in ("key_bias", "pairwise_bias", "query_weights", "with_incoming", "impl")}
"""block_sparse_attention's old keywords (`attention_inputs.ATTENTION_MOVES` of the ones it took)."""


@struct.dataclass
class KeyBlocks:
  """index: [..., B, N, nQb, m] int32 kept key blocks per head and query block, ascending, padded with nKb
  (a model call's field carries a leading [L] axis, one layer's slice has none); block_size: positions per
  block (static)."""

  index: jax.Array
  block_size: int = struct.field(pytree_node=False)


def _blocks(x: jax.Array, axis: int, block_size: int, n_blocks: int, fill: float = 0.0) -> jax.Array:
  """x padded along `axis` to n_blocks·block_size with `fill` and split there into [n_blocks, block_size]."""
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, n_blocks * block_size - x.shape[axis])
  x = jnp.pad(x, widths, constant_values=fill)
  return x.reshape(*x.shape[:axis], n_blocks, block_size, *x.shape[axis + 1:])


def _key_bias_blocks(key_bias, batch: int, heads: int, seq_len: int, block_size: int, n_blocks: int) -> jax.Array:
  """[B, N, nKb, bs] float32: the key bias (or 0) on real keys, MASK_VALUE on the padding past S."""
  bias = jnp.zeros((1, 1, seq_len), jnp.float32) if key_bias is None else key_bias.astype(jnp.float32)
  bias = jnp.broadcast_to(bias, (batch, heads, seq_len))
  return _blocks(bias, 2, block_size, n_blocks, MASK_VALUE)


def block_sparse_attention(q: jax.Array, k: jax.Array, v: jax.Array, blocks: KeyBlocks, *, scale: float,
                           bias: AttentionBias = NO_BIAS, computation: AttentionComputation = DEFAULT_COMPUTATION,
                           **old_keywords) -> tuple[jax.Array, jax.Array | None]:
  """Attention of every query over its head's kept key blocks (module docstring).

  q: [B, T, N, H] with T = S (every position is a query); k, v: [B, S, K, H] (query head n reads key head
  n // (N / K)); blocks: one layer's `KeyBlocks` ([B, N, nQb, m]); scale: multiplier of q·k; bias: its keys
  part [B|1, N|1, S] and pairwise part [B|1, N|1, T|1, S], each or both None; computation
  (`attention_inputs.AttentionComputation`): query_weights [B, Q, T] or None (one group of every query),
  with_incoming (also return the incoming attention), impl ("dense" computes every query block at once, no
  loop: XLA's cost analysis counts it whole; "chunked" or "fused" one query block after the other, `lax.scan`,
  memory O(B·N·bs·m·bs)); its with_rows is refused and query_chunk unused. old_keywords: key_bias=,
  pairwise_bias=, query_weights=, with_incoming=, impl= (deprecated: moved into bias / computation with a
  DeprecationWarning).

  Returns out [B, T, N, H] in v's dtype and incoming [B, Q, N, S] float32 (Σ_t w[b, q, t]·P[b, n, t, s]) or None.
  """
  moved = fold_old_keywords("block_sparse_attention", old_keywords, _MOVES,
                            {"bias": bias, "computation": computation},
                            {"bias": NO_BIAS, "computation": DEFAULT_COMPUTATION})
  bias, computation = moved["bias"], moved["computation"]
  if computation.with_rows:
    raise ValueError("block_sparse_attention returns no attention rows: AttentionComputation.with_rows must be "
                     "False.")
  key_bias, pairwise_bias = bias.keys, bias.pairwise
  query_weights, with_incoming, impl = computation.query_weights, computation.with_incoming, computation.impl
  b, t, n, h = q.shape
  s, kv = k.shape[1], k.shape[2]
  if t != s:
    raise ValueError(f"block_sparse_attention computes every position: q must have S={s} rows, got {t}.")
  g, bs = n // kv, blocks.block_size
  n_q, n_k = -(-t // bs), -(-s // bs)
  m = blocks.index.shape[-1]
  if tuple(blocks.index.shape) != (b, n, n_q, m):
    raise ValueError(f"KeyBlocks.index must be [B, N, nQb, m] = [{b}, {n}, {n_q}, m], got "
                     f"{list(blocks.index.shape)}.")
  key_blocks = jnp.moveaxis(_blocks(k, 1, bs, n_k), 3, 1)  # [B, K, nKb, bs, H]
  value_blocks = jnp.moveaxis(_blocks(v, 1, bs, n_k), 3, 1)
  key_bias_blocks = _key_bias_blocks(key_bias, b, n, s, bs, n_k).reshape(b, kv, g, n_k, bs)
  if with_incoming and query_weights is None:
    query_weights = jnp.ones((b, 1, t), jnp.float32)
  if not with_incoming:
    query_weights = None
  xs = {"q": jnp.moveaxis(_blocks(q, 1, bs, n_q).reshape(b, n_q, bs, kv, g, h), 1, 0),
        "index": jnp.moveaxis(blocks.index.reshape(b, kv, g, n_q, m), 3, 0)}
  if pairwise_bias is not None and pairwise_bias.shape[2] != 1:
    xs["pairwise"] = jnp.moveaxis(_blocks(pairwise_bias, 2, bs, n_q), 2, 0)  # [nQb, B|1, N|1, bs, S]
  if query_weights is not None:
    xs["weights"] = jnp.moveaxis(_blocks(query_weights.astype(jnp.float32), 2, bs, n_q), 2, 0)

  def gather(x, index):
    """x [B, K, nKb, ...] at index [B, K, G, m] -> [B, K, G, m, ...]."""
    flat = index.reshape(b, kv, g * m)
    picked = jnp.take_along_axis(x, flat.reshape(flat.shape + (1,) * (x.ndim - 3)), axis=2)
    return picked.reshape(b, kv, g, m, *x.shape[3:])

  def one_block(chunk):
    """One query block: (its incoming attention [B, K, G, nKb, Q, bs] or None, out [B, bs, K, G, H])."""
    index = chunk["index"]  # [B, K, G, m]
    valid = index < n_k
    at = jnp.minimum(index, n_k - 1)
    keys, values = gather(key_blocks, at), gather(value_blocks, at)  # [B, K, G, m, bs, H]
    scores = jnp.einsum("btkgh,bkgmsh->bkgtms", chunk["q"], keys, preferred_element_type=jnp.float32) * scale
    bias = jnp.take_along_axis(key_bias_blocks, at[..., None], axis=3)  # [B, K, G, m, bs]
    bias = jnp.where(valid[..., None], bias, MASK_VALUE)[:, :, :, None]
    pairwise = chunk.get("pairwise", pairwise_bias)
    if pairwise is not None:
      pairwise = _blocks(jnp.broadcast_to(pairwise.astype(jnp.float32), (b, n, *pairwise.shape[2:])), 3, bs, n_k)
      pairwise = pairwise.reshape(b, kv, g, *pairwise.shape[2:])  # [B, K, G, bs|1, nKb, bs]
      bias = bias + jnp.take_along_axis(pairwise, at[:, :, :, None, :, None], axis=4)
    scores = jnp.maximum(scores + bias, MASK_VALUE)
    probs = jax.nn.softmax(scores.reshape(*scores.shape[:4], m * bs), axis=-1).reshape(scores.shape)
    out = jnp.einsum("bkgtms,bkgmsh->btkgh", probs.astype(v.dtype), values)
    if query_weights is None:
      return None, out
    summed = jnp.einsum("bqt,bkgtms->bqkgms", chunk["weights"], probs)
    rows, key_heads, group = jnp.arange(b)[:, None, None, None], jnp.arange(kv)[:, None, None], jnp.arange(g)[:, None]
    placed = jnp.zeros((b, kv, g, n_k, query_weights.shape[1], bs), jnp.float32)
    return placed.at[rows, key_heads, group, index].add(jnp.moveaxis(summed, 1, 4), mode="drop"), out

  if impl == "dense":
    incoming, outs = jax.vmap(one_block)(xs)
    incoming = None if incoming is None else jnp.sum(incoming, axis=0)
  else:
    def body(total, chunk):
      incoming, out = one_block(chunk)
      return (None if total is None else total + incoming), out

    init = None if query_weights is None else jnp.zeros((b, kv, g, n_k, query_weights.shape[1], bs), jnp.float32)
    incoming, outs = jax.lax.scan(body, init, xs)
  out = jnp.moveaxis(outs, 0, 1).reshape(b, n_q * bs, n, h)[:, :t]
  if incoming is not None:
    incoming = jnp.moveaxis(incoming, 4, 1).reshape(b, query_weights.shape[1], n, n_k * bs)[..., :s]
  return out, incoming


def block_keys_read(blocks: KeyBlocks, seq_len: int) -> jax.Array:
  """[B] float32: the key positions a query reads under `blocks` ([L, B, N, nQb, m]), averaged over the layers,
  heads and the S queries (a partial last block counts its real positions only)."""
  bs = blocks.block_size
  n_q = blocks.index.shape[3]
  sizes = jnp.minimum(bs, seq_len - jnp.arange(n_q + 1) * bs).at[n_q].set(0)  # positions per block; padding 0
  per_block = jnp.sum(sizes[jnp.minimum(blocks.index, n_q)], axis=-1).astype(jnp.float32)  # [L, B, N, nQb]
  rows = sizes[:n_q].astype(jnp.float32)  # queries per query block
  return jnp.mean(jnp.sum(per_block * rows, axis=-1) / seq_len, axis=(0, 2))
