"""Attention core: additive biases in, `(output, incoming attention)` out.

Axis letters used in einsum strings and docstrings throughout the library:
  B batch, T query positions, S key positions, N query heads, K kv heads, G query heads per kv head
  (N = K·G, query head n uses kv head n // G), H head dim, D model dim, F MLP dim, V vocabulary,
  L layers, Q query groups (statistics), C query chunks.

Three implementations share one set of semantics:
  * `dense`: materialises the [B, N, T, S] probabilities; the reference used in tests.
  * `chunked`: scans over chunks of queries, each chunk seeing all keys (an exact row softmax), and
    accumulates the incoming attention; peak memory O(B·N·chunk·S) per layer. The CPU default.
  * `fused`: `jax.nn.dot_product_attention` (cuDNN flash attention on GPUs for bf16/fp16 inputs, XLA
    elsewhere) with its log-sum-exp residual; the incoming attention comes from a second query-chunked
    pass that rebuilds exp(score − lse) chunk by chunk, never materialising [N, T, S].

Besides the biases, two structural patterns are built from indices (never stored as [T, S] inputs):
`causal` (query at sequence index i sees keys 0..i) and `block_size` B (block-causal: i sees j iff
j // B <= i // B). Query sequence indices are `query_offset + row` (a KV-cache call), key indices 0..S-1.

Masking uses a large finite negative value (`MASK_VALUE`); after all biases are added, scores are clamped
from below at `MASK_VALUE`, so stacked masks never overflow to -inf and a row whose keys are all masked
gets a finite (uniform) distribution instead of NaN. A masked key in a row with any visible key receives
exactly zero probability.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dlm_jax.core.attention_bias import MASK_VALUE, NO_BIAS, AttentionBias
from dlm_jax.core.old_keywords import fold_old_keywords
from dlm_jax.model.attention_inputs import (ATTENTION_MOVES, DEFAULT_COMPUTATION, NO_VISIBILITY_LIMIT,
                                            AttentionComputation, AttentionImpl, Visibility)

__all__ = ["MASK_VALUE", "NO_BIAS", "AttentionBias", "AttentionComputation", "AttentionImpl", "Visibility",
           "attention"]



def _heads_to_kv_groups(bias: jax.Array, n_kv_heads: int) -> jax.Array:
  """[B|1, N|1, ...] -> [B|1, K|1, G|1, ...] matching the grouped-query score layout."""
  if bias.shape[1] == 1:
    return bias[:, :, None]
  return bias.reshape(bias.shape[0], n_kv_heads, bias.shape[1] // n_kv_heads, *bias.shape[2:])


def _visible(query_index, key_index, causal, block_size, window=None):
  """[T, S] bool: key j is visible to query i under the causal, block-causal and sliding-window patterns;
  None if none applies.

  query_index: [T] sequence index of each query; key_index: [S]; block_size: B or None; window: W or None
  (key j visible iff i − j < W; with `causal`, the keys i−W+1..i).
  """
  visible = None
  if window is not None:
    visible = query_index[:, None] - key_index[None, :] < window
  if causal:
    before = key_index[None, :] <= query_index[:, None]
    visible = before if visible is None else visible & before
  if block_size is not None:
    same_or_earlier_block = key_index[None, :] // block_size <= query_index[:, None] // block_size
    visible = same_or_earlier_block if visible is None else visible & same_or_earlier_block
  return visible


def _masked_scores(scores, pairwise_bias, key_bias, causal, block_size, query_index, key_index, window=None):
  """Scores [B, K, G, T, S] (float32) plus biases and the structural masks, clamped below at MASK_VALUE.

  pairwise_bias: [B|1, K|1, G|1, T|1, S] or None; key_bias: [B|1, K|1, G|1, S] or None;
  query_index: [T] sequence index of each query (for the structural masks); key_index: [S].
  """
  if pairwise_bias is not None:
    scores = scores + pairwise_bias.astype(jnp.float32)
  if key_bias is not None:
    scores = scores + key_bias[..., None, :].astype(jnp.float32)
  visible = _visible(query_index, key_index, causal, block_size, window)
  if visible is not None:
    scores = jnp.where(visible, scores, MASK_VALUE)
  return jnp.maximum(scores, MASK_VALUE)


def _attend_chunk(q, k, v, *, scale, causal, block_size, pairwise_bias, key_bias, query_weights, query_index,
                  window=None, with_rows=False):
  """Attention of one chunk of queries against all keys.

  q: [B, T, K, G, H]; k, v: [B, S, K, H]; query_weights: [B, Q, T] or None.
  Returns out [B, T, K, G, H], incoming [B, Q, K, G, S] (float32) or None, and with `with_rows` the head-mean
  probabilities [B, T, S] (float32; `attention`).
  """
  scores = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32) * scale
  key_index = jnp.arange(k.shape[1])
  probs = jax.nn.softmax(_masked_scores(scores, pairwise_bias, key_bias, causal, block_size, query_index, key_index,
                                        window), axis=-1)
  out = jnp.einsum("bkgts,bskh->btkgh", probs.astype(v.dtype), v)
  incoming = None
  if query_weights is not None:
    incoming = jnp.einsum("bqt,bkgts->bqkgs", query_weights.astype(jnp.float32), probs)
  if with_rows:
    return out, incoming, jnp.mean(probs, axis=(1, 2))
  return out, incoming


def _check_shapes(q, k, v, pairwise_bias, key_bias, query_weights):
  b, t, n, h = q.shape
  _, s, kv, _ = k.shape
  if k.shape != v.shape or k.shape[0] != b or k.shape[3] != h or n % kv:
    raise ValueError(f"attention expects q [B,T,N,H], k and v [B,S,K,H] with N a multiple of K; "
                     f"got q {q.shape}, k {k.shape}, v {v.shape}.")
  if pairwise_bias is not None:
    ok = (pairwise_bias.ndim == 4 and pairwise_bias.shape[0] in (1, b) and pairwise_bias.shape[1] in (1, n)
          and pairwise_bias.shape[2] in (1, t) and pairwise_bias.shape[3] == s)
    if not ok:
      raise ValueError(f"pairwise_bias must have shape [B|1, N|1, T|1, S] = [{b}|1, {n}|1, {t}|1, {s}], "
                       f"got {pairwise_bias.shape}.")
  if key_bias is not None:
    ok = (key_bias.ndim == 3 and key_bias.shape[0] in (1, b) and key_bias.shape[1] in (1, n)
          and key_bias.shape[2] == s)
    if not ok:
      raise ValueError(f"key_bias must have shape [B|1, N|1, S] = [{b}|1, {n}|1, {s}], got {key_bias.shape}.")
  if query_weights is not None and (query_weights.ndim != 3 or query_weights.shape[0] != b
                                    or query_weights.shape[2] != t):
    raise ValueError(f"query_weights must have shape [B, Q, T] = [{b}, Q, {t}], got {query_weights.shape}.")


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    scale: float,
    visibility: Visibility = NO_VISIBILITY_LIMIT,
    bias: AttentionBias = NO_BIAS,
    computation: AttentionComputation = DEFAULT_COMPUTATION,
    **old_keywords,
) -> tuple[jax.Array, jax.Array | None] | tuple[jax.Array, jax.Array | None, jax.Array]:
  """Scaled dot-product attention with additive biases and exact incoming-attention statistics.

  Args:
    q: [B, T, N, H] queries (RoPE applied).
    k, v: [B, S, K, H] keys and values; N must be a multiple of K.
    scale: multiplier of q·k (1/√H for the supported models).
    visibility: which keys each query sees (`attention_inputs.Visibility`: causal, block_size, window,
      query_offset).
    bias: `AttentionBias` with pairwise [B|1, N|1, T|1, S] and per-key [B|1, N|1, S] additive parts (broadcast
      over queries: key masks, padding), each or both None; not per layer.
    computation: what comes back and how (`attention_inputs.AttentionComputation`: query_weights [B, Q, T],
      with_incoming, with_rows, impl, query_chunk). with_rows: also return the attention rows, every query's
      softmax probabilities over the S keys after every bias and mask, averaged over the N query heads (what
      d2Cache's rollout reads, `dlm_jax.policy.d2cache`), reduced where the probabilities are formed (dense,
      each chunk, the fused path's log-sum-exp pass): N·T·S additions besides the attention, a [B, T, S]
      result.
    old_keywords: the keywords before these structs (causal=, pairwise_bias=, impl=, ...): deprecated, each
      moved into its field (`attention_inputs.ATTENTION_MOVES`) with a DeprecationWarning.

  Returns:
    out: [B, T, N, H] in v's dtype.
    incoming: [B, Q, N, S] float32 — Σ_t weight[b, q, t] · P[b, n, t, s] — or None.
    rows (only with `with_rows`): [B, T, S] float32 — mean_n P[b, n, t, s].
  """
  moved = fold_old_keywords("attention", old_keywords, ATTENTION_MOVES,
                            {"visibility": visibility, "bias": bias, "computation": computation},
                            {"visibility": NO_VISIBILITY_LIMIT, "bias": NO_BIAS, "computation": DEFAULT_COMPUTATION})
  visibility, bias, computation = moved["visibility"], moved["bias"], moved["computation"]
  if bias.pairwise_per_layer or bias.keys_per_layer:
    raise ValueError("attention takes one layer's bias: AttentionBias without a per-layer axis.")
  causal, block_size, window, query_offset = (visibility.causal, visibility.block_size, visibility.window,
                                              visibility.query_offset)
  pairwise_bias, key_bias = bias.pairwise, bias.keys
  query_weights, with_incoming, with_rows = computation.query_weights, computation.with_incoming, computation.with_rows
  impl, query_chunk = computation.impl, computation.query_chunk
  _check_shapes(q, k, v, pairwise_bias, key_bias, query_weights)
  if impl not in ("dense", "chunked", "fused"):
    raise ValueError(f"impl must be 'dense', 'chunked' or 'fused', got {impl!r}.")
  if query_chunk <= 0:
    raise ValueError(f"query_chunk must be positive, got {query_chunk}.")
  if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0):
    raise ValueError(f"block_size must be None or a positive integer, got {block_size!r}.")
  b, t, n, h = q.shape
  kv = k.shape[2]
  q = q.reshape(b, t, kv, n // kv, h)
  if with_incoming and query_weights is None:
    query_weights = jnp.ones((b, 1, t), jnp.float32)
  if not with_incoming:
    query_weights = None
  pairwise = None if pairwise_bias is None else _heads_to_kv_groups(pairwise_bias, kv)
  keys = None if key_bias is None else _heads_to_kv_groups(key_bias, kv)
  query_index = query_offset + jnp.arange(t)
  common = dict(scale=scale, causal=causal, block_size=block_size, key_bias=keys)
  if window is not None:
    common["window"] = window

  rows = None
  if impl == "fused":
    out, lse = _fused(q, k, v, scale, causal, block_size, pairwise, keys, query_offset, window)
    incoming = None
    if query_weights is not None:
      incoming = _incoming_from_lse(q, k, lse, pairwise, query_weights, query_index, query_chunk, common)
    if with_rows:
      rows = _rows_from_lse(q, k, lse, pairwise, query_index, query_chunk, common)
  elif impl == "dense" or t <= query_chunk:
    out, incoming, *rest = _attend_chunk(q, k, v, pairwise_bias=pairwise, query_weights=query_weights,
                                         query_index=query_index, with_rows=with_rows, **common)
    rows = rest[0] if with_rows else None
  else:
    out, incoming, *rest = _chunked(q, k, v, pairwise, query_weights, query_index, query_chunk, common, with_rows)
    rows = rest[0] if with_rows else None
  out = out.reshape(b, t, n, h)
  if incoming is not None:
    incoming = incoming.reshape(b, incoming.shape[1], n, incoming.shape[-1])
  if with_rows:
    return out, incoming, rows
  return out, incoming


def _split_queries(x: jax.Array, axis: int, chunk: int, n_chunks: int) -> jax.Array:
  """Pads `axis` to n_chunks·chunk with zeros and moves the chunk index to the front."""
  pad = n_chunks * chunk - x.shape[axis]
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  x = jnp.pad(x, widths)
  x = x.reshape(*x.shape[:axis], n_chunks, chunk, *x.shape[axis + 1:])
  return jnp.moveaxis(x, axis, 0)


def _query_chunks(chunk: int, q, query_index, pairwise, query_weights, lse=None) -> tuple[dict, int]:
  """The per-query inputs cut into chunks of `chunk` queries, chunk index first (the `lax.scan` xs), and the
  chunk count: q [B, T, K, G, H], query_index [T], a per-query pairwise bias [B, N|1, T, S], query_weights
  [B, Q, T] and lse [B, K, G, T], each when given (a pairwise bias shared by all queries stays whole)."""
  n_chunks = -(-q.shape[1] // chunk)
  xs = {"q": _split_queries(q, 1, chunk, n_chunks), "query_index": _split_queries(query_index, 0, chunk, n_chunks)}
  if pairwise is not None and pairwise.shape[3] != 1:
    xs["pairwise"] = _split_queries(pairwise, 3, chunk, n_chunks)
  if query_weights is not None:
    xs["weights"] = _split_queries(query_weights, 2, chunk, n_chunks)
  if lse is not None:
    xs["lse"] = _split_queries(lse, 3, chunk, n_chunks)
  return xs, n_chunks


def _chunked(q, k, v, pairwise, query_weights, query_index, chunk, common, with_rows=False):
  """Query-chunked exact attention; see `attention`. q: [B, T, K, G, H]. Returns (out, incoming) and, with
  `with_rows`, the head-mean rows [B, T, S]."""
  t = q.shape[1]
  xs, n_chunks = _query_chunks(chunk, q, query_index, pairwise, query_weights)

  def body(incoming_sum, chunk_xs):
    chunk_bias = chunk_xs.get("pairwise", pairwise)
    out, incoming, *rows = _attend_chunk(chunk_xs["q"], k, v, pairwise_bias=chunk_bias,
                                         query_weights=chunk_xs.get("weights"), query_index=chunk_xs["query_index"],
                                         with_rows=with_rows, **common)
    if incoming is not None:
      incoming_sum = incoming_sum + incoming
    return incoming_sum, (out, *rows)

  init = None
  if query_weights is not None:
    b, kv, g = q.shape[0], q.shape[2], q.shape[3]
    init = jnp.zeros((b, query_weights.shape[1], kv, g, k.shape[1]), jnp.float32)
  incoming, (outs, *rows) = jax.lax.scan(body, init, xs)
  out = jnp.moveaxis(outs, 0, 1)
  out = out.reshape(out.shape[0], n_chunks * chunk, *out.shape[3:])[:, :t]
  if with_rows:
    return out, incoming, _unchunk_rows(rows[0], t)
  return out, incoming


def _unchunk_rows(rows: jax.Array, t: int) -> jax.Array:
  """[C, B, chunk, S] rows of the query chunks -> [B, T, S] (the padding queries dropped)."""
  rows = jnp.moveaxis(rows, 0, 1)
  return rows.reshape(rows.shape[0], -1, rows.shape[-1])[:, :t]


def _fused(q, k, v, scale, causal, block_size, pairwise, keys, query_offset, window=None):
  """Fused-kernel attention. q: [B, T, K, G, H]. Returns out [B, T, K, G, H] in v's dtype and lse [B, K, G, T].
  The kernel takes one dtype: q, k and v run in their common one (as the einsums of the other paths promote),
  e.g. float32 queries (RoPE in float32) over a bfloat16 KV cache."""
  out_dtype = v.dtype
  common_dtype = jnp.result_type(q, k, v)
  q, k, v = q.astype(common_dtype), k.astype(common_dtype), v.astype(common_dtype)
  b, t, kv, g, h = q.shape
  s = k.shape[1]
  bias = None
  for term in (pairwise, None if keys is None else keys[..., None, :]):
    if term is not None:
      term = term.astype(jnp.float32)
      term = term.reshape(term.shape[0], -1, *term.shape[3:]) if term.shape[1:3] != (1, 1) else term[:, 0]
      bias = term if bias is None else bias + term
  static_causal = causal and isinstance(query_offset, int) and query_offset == 0 and t == s
  visible = _visible(query_offset + jnp.arange(t), jnp.arange(s), causal and not static_causal, block_size, window)
  if visible is not None:
    structure_bias = jnp.where(visible, 0.0, MASK_VALUE)
    bias = structure_bias[None, None] if bias is None else bias + structure_bias
  if bias is not None:
    bias = jnp.maximum(bias, 0.7 * float(jnp.finfo(q.dtype).min)).astype(q.dtype)
  out, lse = jax.nn.dot_product_attention(
      q.reshape(b, t, kv * g, h), k, v, bias=bias, scale=scale, is_causal=static_causal, return_residual=True)
  lse = lse.astype(jnp.float32).reshape(b, t, kv, g).transpose(0, 2, 3, 1)
  return out.reshape(b, t, kv, g, h).astype(out_dtype), lse


def _chunk_probs_from_lse(chunk_xs, k, pairwise, key_index, common):
  """One query chunk's probabilities exp(score − lse) [B, K, G, C, S] float32 (the fused path's second pass)."""
  scores = jnp.einsum("btkgh,bskh->bkgts", chunk_xs["q"], k, preferred_element_type=jnp.float32)
  scores = _masked_scores(scores * common["scale"], chunk_xs.get("pairwise", pairwise), common["key_bias"],
                          common["causal"], common["block_size"], chunk_xs["query_index"], key_index,
                          common.get("window"))
  return jnp.exp(scores - chunk_xs["lse"][..., None])


def _incoming_from_lse(q, k, lse, pairwise, query_weights, query_index, chunk, common):
  """Σ_t w[b, q, t] · exp(score[t, s] − lse[t]) by chunks of queries: [B, Q, K, G, S] float32."""
  xs, _ = _query_chunks(chunk, q, query_index, pairwise, query_weights, lse)
  key_index = jnp.arange(k.shape[1])

  def body(total, chunk_xs):
    probs = _chunk_probs_from_lse(chunk_xs, k, pairwise, key_index, common)
    return total + jnp.einsum("bqt,bkgts->bqkgs", chunk_xs["weights"].astype(jnp.float32), probs), None

  b, kv, g = q.shape[0], q.shape[2], q.shape[3]
  init = jnp.zeros((b, query_weights.shape[1], kv, g, k.shape[1]), jnp.float32)
  return jax.lax.scan(body, init, xs)[0]


def _rows_from_lse(q, k, lse, pairwise, query_index, chunk, common):
  """mean_n exp(score[t, s] − lse[t]) by chunks of queries: the head-mean rows [B, T, S] float32."""
  xs, _ = _query_chunks(chunk, q, query_index, pairwise, None, lse)
  key_index = jnp.arange(k.shape[1])

  def body(_, chunk_xs):
    return None, jnp.mean(_chunk_probs_from_lse(chunk_xs, k, pairwise, key_index, common), axis=(1, 2))

  return _unchunk_rows(jax.lax.scan(body, None, xs)[1], q.shape[1])
