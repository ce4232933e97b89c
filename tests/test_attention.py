"""The attention core against a NumPy reference; chunked path against the dense path."""

import numpy as np
import pytest
import jax.numpy as jnp

from dlm_jax.model.attention import MASK_VALUE, attention


def numpy_attention(q, k, v, scale, causal, bias, query_weights):
  """Plain NumPy reference. q [B,T,N,H], k/v [B,S,K,H], bias broadcastable to [B,N,T,S], weights [B,Q,T]."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  b, t, n, h = q.shape
  s, kv = k.shape[1], k.shape[2]
  group = n // kv
  out = np.zeros((b, t, n, h))
  probs = np.zeros((b, n, t, s))
  for head in range(n):
    kh, vh = k[:, :, head // group], v[:, :, head // group]
    scores = np.einsum("bth,bsh->bts", q[:, :, head], kh) * scale
    scores = scores + np.broadcast_to(np.asarray(bias, np.float64), (b, n, t, s))[:, head]
    if causal:
      scores = np.where(np.arange(s)[None, :] <= np.arange(t)[:, None], scores, -np.inf)
    scores = scores - scores.max(-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(-1, keepdims=True)
    probs[:, head] = p
    out[:, :, head] = np.einsum("bts,bsh->bth", p, vh)
  incoming = np.einsum("bqt,bnts->bqns", np.asarray(query_weights, np.float64), probs)
  return out, incoming, probs


def _inputs(seed, b=2, t=11, n=6, kv=2, h=8):
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(b, t, n, h)).astype(np.float32)
  k = rng.normal(size=(b, t, kv, h)).astype(np.float32)
  v = rng.normal(size=(b, t, kv, h)).astype(np.float32)
  return rng, q, k, v


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("impl, chunk", [("dense", 128), ("chunked", 4), ("chunked", 5), ("chunked", 11),
                                         ("fused", 4), ("fused", 128)])
def test_matches_numpy_with_bias_and_query_groups(causal, impl, chunk):
  rng, q, k, v = _inputs(0)
  pairwise = rng.normal(size=(2, 6, 11, 11)).astype(np.float32)
  key_bias = rng.normal(size=(2, 1, 11)).astype(np.float32)
  weights = (rng.random(size=(2, 3, 11)) < 0.5).astype(np.float32)
  out, incoming = attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), scale=0.3, causal=causal,
                            pairwise_bias=jnp.asarray(pairwise), key_bias=jnp.asarray(key_bias),
                            query_weights=jnp.asarray(weights), with_incoming=True, impl=impl, query_chunk=chunk)
  ref_out, ref_incoming, _ = numpy_attention(q, k, v, 0.3, causal, pairwise + key_bias[:, :, None, :], weights)
  np.testing.assert_allclose(out, ref_out, atol=1e-5)
  np.testing.assert_allclose(incoming, ref_incoming, atol=1e-5)


def test_chunked_equals_dense_for_every_bias_shape():
  rng, q, k, v = _inputs(1, t=13)
  for pairwise_shape in [(1, 1, 13, 13), (2, 1, 1, 13), (2, 6, 13, 13)]:
    for key_shape in [(1, 1, 13), (2, 6, 13)]:
      args = dict(scale=0.25, pairwise_bias=jnp.asarray(rng.normal(size=pairwise_shape), jnp.float32),
                  key_bias=jnp.asarray(rng.normal(size=key_shape), jnp.float32), with_incoming=True)
      dense = attention(q, k, v, impl="dense", **args)
      for impl in ("chunked", "fused"):
        other = attention(q, k, v, impl=impl, query_chunk=3, **args)
        np.testing.assert_allclose(other[0], dense[0], atol=1e-5, err_msg=impl)
        np.testing.assert_allclose(other[1], dense[1], atol=1e-5, err_msg=impl)


def test_incoming_attention_sums_to_query_count():
  _, q, k, v = _inputs(2)
  _, incoming = attention(q, k, v, scale=0.5, with_incoming=True, query_chunk=4)
  assert incoming.shape == (2, 1, 6, 11)
  np.testing.assert_allclose(incoming.sum(-1), 11.0, rtol=1e-6)


@pytest.mark.parametrize("impl", ["dense", "chunked", "fused"])
def test_masked_key_gets_exactly_zero_and_fully_masked_rows_stay_finite(impl):
  _, q, k, v = _inputs(3)
  key_bias = np.zeros((2, 1, 11), np.float32)
  key_bias[:, :, 4] = MASK_VALUE
  pairwise = np.zeros((2, 1, 11, 11), np.float32)
  pairwise[:, :, 7, :] = MASK_VALUE  # query 7 sees no key at all
  with np.errstate(over="ignore"):
    pairwise[:, :, :, 4] += MASK_VALUE  # -inf where stacked with row 7: must still give finite rows
  weights = np.eye(11, dtype=np.float32)[None].repeat(2, 0)  # one group per query: rows of P
  out, rows = attention(q, k, v, scale=0.5, key_bias=jnp.asarray(key_bias), pairwise_bias=jnp.asarray(pairwise),
                        query_weights=jnp.asarray(weights), with_incoming=True, impl=impl, query_chunk=4)
  assert np.isfinite(np.asarray(out)).all() and np.isfinite(np.asarray(rows)).all()
  rows = np.asarray(rows)  # [B, T, N, S]
  visible_rows = np.delete(rows, 7, axis=1)
  assert (visible_rows[..., 4] == 0.0).all()
  np.testing.assert_allclose(visible_rows.sum(-1), 1.0, rtol=1e-6)


@pytest.mark.parametrize("impl", ["dense", "chunked", "fused"])
def test_query_offset_shifts_the_causal_mask(impl):
  _, q, k, v = _inputs(4)
  full, full_in = attention(q, k, v, scale=0.5, causal=True, with_incoming=True, impl="dense")
  tail, tail_in = attention(q[:, 8:], k, v, scale=0.5, causal=True, query_offset=8, with_incoming=True, impl=impl,
                            query_chunk=2)
  np.testing.assert_allclose(tail, full[:, 8:], atol=1e-6)
  _, head_in = attention(q[:, :8], k[:, :8], v[:, :8], scale=0.5, causal=True, with_incoming=True, impl=impl)
  np.testing.assert_allclose(tail_in[..., :8] + head_in, full_in[..., :8], atol=1e-5)


def test_bad_shapes_are_named():
  _, q, k, v = _inputs(5)
  with pytest.raises(ValueError, match="key_bias must have shape"):
    attention(q, k, v, scale=1.0, key_bias=jnp.zeros((2, 3, 11)))
  with pytest.raises(ValueError, match="pairwise_bias must have shape"):
    attention(q, k, v, scale=1.0, pairwise_bias=jnp.zeros((2, 1, 11, 10)))
  with pytest.raises(ValueError, match="multiple of K"):
    attention(q[:, :, :5], k, v, scale=1.0)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("impl, chunk", [("dense", 128), ("chunked", 4), ("fused", 4), ("fused", 128)])
def test_sliding_window_matches_numpy(causal, impl, chunk):
  """window W: query i sees key j iff i − j < W (with causal: the keys i−W+1..i), also with a query offset."""
  rng, q, k, v = _inputs(2)
  window, offset = 3, 2
  t = 7
  q = q[:, :t]
  query_index = offset + np.arange(t)
  visible = query_index[:, None] - np.arange(11)[None, :] < window
  if causal:
    visible &= np.arange(11)[None, :] <= query_index[:, None]
  bias = np.where(visible, 0.0, -np.inf)[None, None]
  weights = np.ones((2, 1, t), np.float32)
  out, incoming = attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), scale=0.3, causal=causal, window=window,
                            query_offset=offset, with_incoming=True, impl=impl, query_chunk=chunk)
  ref_out, ref_incoming, _ = numpy_attention(q, k, v, 0.3, False, bias, weights)
  np.testing.assert_allclose(out, ref_out, atol=1e-5)
  np.testing.assert_allclose(incoming, ref_incoming, atol=1e-5)


def test_fused_takes_float32_queries_over_a_bfloat16_cache():
  """RoPE in float32 gives float32 queries while a bfloat16 KV cache holds the keys and values: the fused
  kernel wants one dtype, so it runs in their common one and returns v's dtype, as the chunked path does."""
  _, q, k, v = _inputs(3)
  k, v = jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16)
  fused, fused_in = attention(q, k, v, scale=0.3, impl="fused", with_incoming=True)
  chunked, chunked_in = attention(q, k, v, scale=0.3, impl="chunked", with_incoming=True)
  assert fused.dtype == chunked.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(fused, np.float32), np.asarray(chunked, np.float32), atol=2e-2)
  np.testing.assert_allclose(fused_in, chunked_in, atol=1e-5)
