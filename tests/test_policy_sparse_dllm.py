"""Sparse-dLLM's rule against a NumPy replay of the official `CustomCache.filter_cache` (operations in the
official order: cut the block out of the keys, repeat KV heads, mean the block's queries, dot, head mean,
max-pool with -inf padding, int(n x ratio) top keys by torch.topk itself), both pooling conventions, both
tie rules, schedule and knobs."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dlm_jax.policy import sparse_dllm
from dlm_jax.policy.sparse_dllm import SparseDLLMSettings

B, S, L, N, K, H = 3, 70, 6, 4, 2, 8


def _torch_top(values, count):
  return torch.topk(torch.tensor(values, dtype=torch.float32), count).indices.numpy()


def _lowest_first_top(values, count):
  return np.argsort(-values, kind="stable")[:count]


def _official_kept(q_block, k, block_start, keep_ratio, kernel_size, top=_torch_top):
  """filter_cache for one row: q_block [L, N, H], k [S, K, H] -> sorted kept sequence positions."""
  outside = np.concatenate([k[:block_start], k[block_start + L:]], axis=0)
  outside = np.repeat(outside, N // K, axis=1)
  avg_q = q_block.mean(axis=0)
  scores = np.einsum("nh,snh->ns", avg_q, outside)
  importance = scores.mean(axis=0)
  if kernel_size > 1:
    half = kernel_size // 2
    padded = np.concatenate([np.full(half, -np.inf), importance, np.full(half, -np.inf)])
    importance = np.array([padded[j:j + kernel_size].max() for j in range(len(importance))])
  keep_num = int(importance.shape[-1] * keep_ratio)
  chosen = top(importance, keep_num)
  return np.sort(np.where(chosen >= block_start, chosen + L, chosen))


def _clean_kept(q_block, k, block_start, keep_ratio, kernel_size, top=_lowest_first_top):
  """The clean rule: pooling in sequence coordinates, the block's positions scored -inf."""
  avg_q = q_block.mean(axis=0)
  scores = np.einsum("nh,snh->ns", avg_q, np.repeat(k, N // K, axis=1)).mean(axis=0)
  in_block = (np.arange(S) >= block_start) & (np.arange(S) < block_start + L)
  scores = np.where(in_block, -np.inf, scores)
  half = kernel_size // 2
  padded = np.concatenate([np.full(half, -np.inf), scores, np.full(half, -np.inf)])
  pooled = np.array([padded[j:j + kernel_size].max() for j in range(S)])
  pooled = np.where(in_block, -np.inf, pooled)
  return np.sort(top(pooled, int((S - L) * keep_ratio)))


@functools.lru_cache(maxsize=None)
def _compiled(settings):
  def run(q_block, k, block_start):
    scores = sparse_dllm.block_query_key_scores(q_block, k)
    kept = sparse_dllm.keep_positions(scores, block_start, L, settings)
    return kept, sparse_dllm.attended_keys(kept, block_start, L)
  return jax.jit(run)


@pytest.mark.parametrize("keep_ratio,kernel_size,pool_across_block_gap,tie_break", [
    (0.5, 3, True, "torch_cpu"), (0.5, 3, False, "lowest_position"), (0.3, 5, True, "lowest_position"),
    (0.7, 1, False, "lowest_position")])
def test_kept_keys_match_the_replay(keep_ratio, kernel_size, pool_across_block_gap, tie_break):
  rng = np.random.default_rng(int(keep_ratio * 10) + kernel_size)
  settings = SparseDLLMSettings(keep_ratio=keep_ratio, kernel_size=kernel_size,
                                pool_across_block_gap=pool_across_block_gap, tie_break=tie_break)
  replay = _official_kept if pool_across_block_gap else _clean_kept
  top = _torch_top if tie_break == "torch_cpu" else _lowest_first_top
  ties_decided = 0
  for starts in ([0, 30, 64], [20, 7, 50]):
    # float16-valued scores: the head-mean dot products tie more often, as in the official bfloat16.
    q_block = rng.standard_normal((B, L, N, H)).astype(np.float16).astype(np.float32)
    k = rng.standard_normal((B, S, K, H)).astype(np.float16).astype(np.float32)
    kept, keys = _compiled(settings)(q_block, k, jnp.asarray(starts, jnp.int32))
    assert kept.shape == (B, sparse_dllm.keep_count(S, L, keep_ratio))
    for b, start in enumerate(starts):
      args = (q_block[b].astype(np.float64), k[b].astype(np.float64), start, keep_ratio, kernel_size)
      expected = replay(*args, top=top)
      np.testing.assert_array_equal(np.asarray(kept[b]), expected)
      np.testing.assert_array_equal(np.asarray(keys[b]), np.concatenate([expected, np.arange(start, start + L)]))
      other = _lowest_first_top if tie_break == "torch_cpu" else _torch_top
      ties_decided += not np.array_equal(replay(*args, top=other), expected)
  if tie_break == "torch_cpu":
    assert ties_decided > 0  # the case does exercise ties at the cut that the two rules decide differently


def test_the_two_pooling_conventions_differ_where_the_block_joins_its_neighbours():
  # Block [10, 16); one high key at 9, every other key -1. Laid end to end, the first suffix key (16)
  # is 9's pooling neighbour and ties with it; in sequence coordinates its neighbours are the block (-inf)
  # and 17, so the third kept key is the lowest of the -1 ties, position 0.
  scores = np.full((1, 26), -1.0, np.float32)
  scores[0, 9] = 5.0
  settings = SparseDLLMSettings(keep_ratio=0.15, tie_break="lowest_position")
  assert sparse_dllm.keep_count(26, L, 0.15) == 3
  clean_settings = SparseDLLMSettings(keep_ratio=0.15, pool_across_block_gap=False, tie_break="lowest_position")
  official, clean = jax.jit(lambda s: (sparse_dllm.keep_positions(s, 10, L, settings),
                                       sparse_dllm.keep_positions(s, 10, L, clean_settings)))(scores)
  np.testing.assert_array_equal(np.asarray(official[0]), [8, 9, 16])
  np.testing.assert_array_equal(np.asarray(clean[0]), [0, 8, 9])


def test_schedule():
  steps = jnp.arange(6)
  np.testing.assert_array_equal(np.asarray(sparse_dllm.is_full_step(steps)), [1, 1, 0, 0, 0, 0])
  np.testing.assert_array_equal(np.asarray(sparse_dllm.is_selection_step(steps)), [0, 1, 0, 0, 0, 0])


def test_published_and_bad_knobs():
  assert SparseDLLMSettings.published("llada") == SparseDLLMSettings(keep_ratio=0.5, kernel_size=3)
  assert SparseDLLMSettings.published("dream", "humaneval") == SparseDLLMSettings()
  assert SparseDLLMSettings.NAME == "sparse_dllm"
  with pytest.raises(ValueError, match="families"):
    SparseDLLMSettings.published("mmada")
  for knobs, message in [({"keep_ratio": 0.0}, "keep_ratio"), ({"keep_ratio": 1.5}, "keep_ratio"),
                         ({"kernel_size": 2}, "kernel_size must be an odd"), ({"kernel_size": 0}, "kernel_size"),
                         ({"pool_across_block_gap": 1}, "pool_across_block_gap"), ({"tie_break": "x"}, "tie_break")]:
    with pytest.raises(ValueError, match=message) as error:
      SparseDLLMSettings(**knobs)
    assert "\n" not in str(error.value)
