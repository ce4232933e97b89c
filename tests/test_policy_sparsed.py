"""SparseD's rule against a NumPy replay of the official step-E loop (per query block: softmax over all keys,
`create_attention_block_mask`, generation columns cleared; then softmax over the generation keys only,
OR-ed in), both score scales, the generation boundary, the warm-up schedule and the knobs."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlm_jax.policy import sparsed
from dlm_jax.policy.sparsed import SparseDSettings

B, N, K, H = 2, 4, 2, 8


def _block_mask(weights, block_size, keep_ratio):
  """create_attention_block_mask: weights [B, N, q_len, kv_len] -> [B, N, nQb, nKb] bool."""
  b, n, q_len, kv_len = weights.shape
  n_q, n_k = -(-q_len // block_size), -(-kv_len // block_size)
  padded = np.zeros((b, n, n_q * block_size, n_k * block_size))
  padded[:, :, :q_len, :kv_len] = weights
  importance = np.abs(padded).reshape(b, n, n_q, block_size, n_k, block_size).mean(axis=(3, 5))
  keep = min(max(1, int(n_k * keep_ratio) + 1), n_k)
  order = np.argsort(-importance, axis=-1, kind="stable")[..., :keep]
  mask = np.zeros(importance.shape, bool)
  np.put_along_axis(mask, order, True, axis=-1)
  return mask


def _softmax(x):
  x = x - x.max(axis=-1, keepdims=True)
  e = np.exp(x)
  return e / e.sum(axis=-1, keepdims=True)


def _official_mask(q, k, block_size, select, new_generation, divisor):
  """The step-E branch of LLaDABlock.attention: q [B, N, S, H], k [B, N, S, H] (heads repeated)."""
  q_len = kv_len = q.shape[2]
  n_blocks = -(-q_len // block_size)
  fine = np.zeros((q.shape[0], q.shape[1], n_blocks, -(-kv_len // block_size)), bool)
  last = None
  for idx in range(n_blocks):
    if q_len - idx * block_size <= new_generation or idx == n_blocks - 1:
      if last is None:
        last = idx
    q_reduce = q[:, :, idx * block_size:(idx + 1) * block_size]
    weights = _softmax(np.einsum("bnqh,bnkh->bnqk", q_reduce, k) / np.sqrt(divisor))
    fine[:, :, idx:idx + 1, :] = _block_mask(weights, block_size, select)
  fine[:, :, :, last:] = False
  k_reduce = k[:, :, last * block_size:]
  for idx in range(n_blocks):
    q_reduce = q[:, :, idx * block_size:(idx + 1) * block_size]
    weights = _softmax(np.einsum("bnqh,bnkh->bnqk", q_reduce, k_reduce) / np.sqrt(divisor))
    fine[:, :, idx:idx + 1, last:] |= _block_mask(weights, block_size, select)
  return fine, last


@functools.lru_cache(maxsize=None)
def _compiled(settings, generation):
  def run(q, k):
    scale = sparsed.score_scale(settings, N, H)
    pooled_all, pooled_generation = sparsed.pooled_statistics(q, k, settings, scale, generation)
    return sparsed.keep_mask(pooled_all, pooled_generation, settings.select, generation)
  return jax.jit(run)


@pytest.mark.parametrize("seq_len,gen_length,block_size,select,scale", [
    (20, 12, 4, 0.3, "num_heads"),  # prompt a block multiple
    (18, 6, 5, 0.5, "head_dim")])  # block 2 straddles the prompt's end, the last block is partial
def test_mask_matches_the_replay(seq_len, gen_length, block_size, select, scale):
  rng = np.random.default_rng(seq_len)
  settings = SparseDSettings(select=select, block_size=block_size, score_scale=scale)
  q = rng.standard_normal((B, seq_len, N, H)).astype(np.float32) * 2
  k = rng.standard_normal((B, seq_len, K, H)).astype(np.float32) * 2
  generation = sparsed.generation_block(seq_len, gen_length, block_size)
  expected, last = _official_mask(np.moveaxis(q, 2, 1).astype(np.float64),
                                  np.repeat(np.moveaxis(k, 2, 1), N // K, axis=1).astype(np.float64),
                                  block_size, select, gen_length, N if scale == "num_heads" else H)
  assert generation == last
  mask = _compiled(settings, generation)(q, k)
  np.testing.assert_array_equal(np.asarray(mask), expected)
  dense = np.asarray(sparsed.dense_mask(mask, seq_len, block_size))
  assert dense.shape == (B, N, seq_len, seq_len)
  np.testing.assert_array_equal(dense[:, :, ::block_size, ::block_size], expected)


def test_probabilities_pool_and_boundary():
  rng = np.random.default_rng(1)
  q = rng.standard_normal((1, 7, N, H)).astype(np.float32)
  k = rng.standard_normal((1, 7, K, H)).astype(np.float32)
  run = jax.jit(lambda q, k: (lambda p: (p, sparsed.block_pool(p, 4)))(
      sparsed.attention_probabilities(q, k, 0.5, key_start=3)))
  p, pooled = map(np.asarray, run(q, k))
  np.testing.assert_allclose(p.sum(-1), 1.0, rtol=1e-6)
  assert (p[..., :3] == 0).all()
  assert pooled.shape == (1, N, 2, 2)
  np.testing.assert_allclose(pooled[0, 0, 1, 1], p[0, 0, 4:, 4:].sum() / 16, rtol=1e-6)
  # Prompt of 10 in blocks of 4: block 2 (positions 8..11) straddles the boundary and counts as prompt.
  assert sparsed.generation_block(22, 12, 4) == 3
  assert sparsed.generation_block(20, 12, 4) == 2
  assert sparsed.generation_block(20, 2, 8) == 2
  assert sparsed.boundary_length(SparseDSettings(), 12, 24) == 12
  assert sparsed.boundary_length(SparseDSettings(boundary_from="steps"), 12, 24) == 24


def test_schedule():
  end = sparsed.warmup_end(128, 0.2)
  assert end == 26 and sparsed.warmup_end(256, 0.0) == 1
  steps = jnp.array([0, 25, 26, 27, 127])
  np.testing.assert_array_equal(np.asarray(sparsed.is_full_step(steps, end)), [1, 1, 1, 0, 0])
  np.testing.assert_array_equal(np.asarray(sparsed.is_selection_step(steps, end)), [0, 0, 1, 0, 0])
  np.testing.assert_array_equal(np.asarray(sparsed.uses_mask(steps, end)), [0, 0, 0, 1, 1])


def test_published_and_bad_knobs():
  assert SparseDSettings.published("llada", "short_context") == SparseDSettings(select=0.5, block_size=32)
  assert SparseDSettings.published("llada", "4k") == SparseDSettings()
  dream = SparseDSettings.published("dream", "64k")
  assert (dream.score_scale, dream.boundary_from, dream.select) == ("head_dim", "steps", 0.3)
  assert SparseDSettings.NAME == "sparsed"
  with pytest.raises(ValueError, match="families"):
    SparseDSettings.published("mmada")
  with pytest.raises(ValueError, match="tasks"):
    SparseDSettings.published("llada", "longbench")
  for knobs, message in [({"skip": 1.0}, "skip"), ({"skip": -0.1}, "skip"), ({"select": 0.0}, "select"),
                         ({"block_size": 0}, "block_size"), ({"score_scale": "d"}, "score_scale"),
                         ({"boundary_from": "x"}, "boundary_from")]:
    with pytest.raises(ValueError, match=message) as error:
      SparseDSettings(**knobs)
    assert "\n" not in str(error.value)
