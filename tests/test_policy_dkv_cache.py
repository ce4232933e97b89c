"""dKV-Cache decode's rule against a replay of the official `generate` loop's bookkeeping (prv / cur transfer
masks, the full-or-cached if-chain, the cache rebuilt from the positions decoded before each call) on random
decode orders: same full steps, same computed positions, and every cached K/V row comes from the same call
as in the official cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlm_jax.policy import dkv_cache
from dlm_jax.policy.dkv_cache import DKVCacheSettings

MASK = 99
B, PROMPT = 2, 5


def _transfer_counts(masked, steps):
  base, remainder = divmod(masked, steps)
  return [base + (1 if i < remainder else 0) for i in range(steps)]


@pytest.mark.parametrize("gen_length,block_length,steps,reload", [(12, 4, 8, 2), (12, 6, 12, 3), (8, 8, 8, 8),
                                                                  (9, 3, 9, 1)])
def test_rule_matches_the_official_loop(gen_length, block_length, steps, reload):
  rng = np.random.default_rng(gen_length * 100 + reload)
  settings = DKVCacheSettings(cache_reloading_step=reload)
  seq_len = PROMPT + gen_length
  positions = jax.jit(lambda was_masked: dkv_cache.query_positions(dkv_cache.DecodeEvents(was_masked), PROMPT))
  full_of = jax.jit(lambda step: dkv_cache.is_full_step(step, settings))
  x = np.full((B, seq_len), MASK)
  x[:, :PROMPT] = rng.integers(0, 50, (B, PROMPT))
  steps_per_block = steps // (gen_length // block_length)
  events = dkv_cache.start(B, seq_len)
  last_computed = np.full((B, seq_len), -1)
  call = 0
  for block in range(gen_length // block_length):
    prv = cur = None
    official_cache = None
    counts = [_transfer_counts(block_length, steps_per_block) for _ in range(B)]
    for i in range(steps_per_block):
      cached = i % reload != 0 and i > 1
      assert bool(full_of(jnp.int32(i))) == (not cached)
      if cached:
        queries = ~prv
        indices, valid = map(np.asarray, positions(jnp.asarray(events.was_masked)))
        np.testing.assert_array_equal(np.asarray(dkv_cache.query_mask(events)), queries)
        for b in range(B):
          assert not queries[b, :PROMPT].any()
          np.testing.assert_array_equal(indices[b][valid[b]], np.flatnonzero(queries[b]))
          read_from_cache = np.flatnonzero(prv[b])
          assert all(official_cache[b][p] == last_computed[b, p] for p in read_from_cache)
        official_cache = [{p: (call if queries[b, p] else official_cache[b][p]) for p in np.flatnonzero(cur[b])}
                          for b in range(B)]
        last_computed[queries] = call
      else:
        if i > 0:
          official_cache = [{p: call for p in np.flatnonzero(cur[b])} for b in range(B)]
        last_computed[:] = call
      events = dkv_cache.record_call(jnp.asarray(x), MASK)
      lo = PROMPT + block * block_length
      for b in range(B):
        candidates = np.flatnonzero(x[b, lo:lo + block_length] == MASK) + lo
        chosen = rng.permutation(candidates)[:counts[b][i]]
        x[b, chosen] = rng.integers(0, 50, len(chosen))
      prv, cur = cur, x != MASK
      call += 1
  assert (x != MASK).all()


def test_budget_padding_and_start():
  was_masked = np.zeros((1, 9), bool)
  was_masked[0, [4, 7]] = True
  indices, valid = jax.jit(lambda m: dkv_cache.query_positions(dkv_cache.DecodeEvents(m), 3))(was_masked)
  np.testing.assert_array_equal(np.asarray(indices[0]), [4, 7, 3, 5, 6, 8])
  np.testing.assert_array_equal(np.asarray(valid[0]), [1, 1, 0, 0, 0, 0])
  assert bool(dkv_cache.start(2, 5).was_masked.all())


def test_published_and_bad_knobs():
  assert DKVCacheSettings.published("llada") == DKVCacheSettings(cache_reloading_step=8)
  assert DKVCacheSettings.NAME == "dkv_cache"
  with pytest.raises(ValueError, match="Dream"):
    DKVCacheSettings.published("dream")
  for value in (0, -2, 1.5, True):
    with pytest.raises(ValueError, match="cache_reloading_step") as error:
      DKVCacheSettings(cache_reloading_step=value)
    assert "\n" not in str(error.value)
