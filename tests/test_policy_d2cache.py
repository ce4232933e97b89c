"""d2Cache's decision functions against NumPy replays written here from the official code's order of operations
(Kamichanw/d2Cache `src/cache/d2cache.py` `accumulate_attn_rollout` / `on_step_end` / `top_up_mask`,
`src/utils/common.py` `certainty_density` (by FFT, as the original) / `nucleus_select` / `top_up_mask_`): the
rollout with explicit S×S matrices, the query set with loops. Small random arrays, float64 replays."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlm_jax.policy import d2cache
from dlm_jax.policy.d2cache import D2CacheSettings
from dlm_jax.policy.index_sets import mask_to_index_set

jax.config.update("jax_default_matmul_precision", "highest")


def softmax_rows(rng, shape):
  x = rng.normal(size=shape) * 2.0
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def replay_rollout(rows, positions, valid):
  """S×S rollout exactly as accumulate_attn_rollout builds it, then the column sums."""
  n_layers, b, _, s = rows.shape
  rollout = np.broadcast_to(np.eye(s), (b, s, s)).copy()
  for layer in range(n_layers):
    effective = np.broadcast_to(np.eye(s), (b, s, s)).copy()
    for row in range(b):
      for q in range(rows.shape[2]):
        if valid[row, q]:
          effective[row, positions[row, q]] = rows[layer, row, q]
    residual = effective + np.eye(s)
    residual = residual / residual.sum(-1, keepdims=True)
    rollout = residual @ rollout
  return rollout.sum(axis=1)


@functools.lru_cache(maxsize=None)
def rollout_fn():
  """Both exact forms: top-down on vectors from the stacked rows, and bottom-up with the [B, Tq, S] carry."""
  def both(rows, positions, valid):
    def layer(carry, a):
      return d2cache.rollout_rows_step(carry, a, positions, valid), None
    init = d2cache.rollout_rows_init(positions, valid, rows.shape[-1])
    carry, _ = jax.lax.scan(layer, init, rows)
    return (d2cache.rollout_importance(rows, positions, valid),
            d2cache.rollout_rows_importance(carry, positions, valid))
  return jax.jit(both)


def test_rollout_importance_matches_explicit_product():
  rng = np.random.default_rng(0)
  n_layers, b, s, tq = 3, 2, 9, 4
  rows = softmax_rows(rng, (n_layers, b, tq, s))
  positions = np.array([[1, 4, 5, 8], [0, 2, 7, 7]], np.int32)
  valid = np.array([[True, True, True, True], [True, True, True, False]])
  want = replay_rollout(rows, positions, valid)
  for got in rollout_fn()(jnp.asarray(rows, jnp.float32), jnp.asarray(positions), jnp.asarray(valid)):
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-6)
  full = softmax_rows(rng, (n_layers, b, s, s))
  every = np.broadcast_to(np.arange(s, dtype=np.int32), (b, s))
  want_full = replay_rollout(full, every, np.ones((b, s), bool))
  for got in rollout_fn()(jnp.asarray(full, jnp.float32), jnp.asarray(every), jnp.ones((b, s), bool)):
    np.testing.assert_allclose(np.asarray(got), want_full, rtol=2e-5, atol=2e-6)


def replay_density(decoded, sigma):
  """certainty_density by FFT, as the official function."""
  b, g = decoded.shape
  padded = np.pad(decoded.astype(np.float64), ((0, 0), (g, g)), constant_values=1.0)
  padded[~decoded[:, -1], 2 * g:] = 0.0
  ext, n = 3 * g, 6 * g
  dist = np.concatenate([np.arange(ext), np.arange(-ext, 0)]).astype(np.float64)
  kernel = np.fft.fft(np.exp(-dist ** 2 / (2 * sigma ** 2)), n=n)
  weighted = np.fft.ifft(np.fft.fft(np.pad(padded, ((0, 0), (0, ext))), n=n) * kernel, n=n).real
  total = np.fft.ifft(np.fft.fft(np.ones((b, n)), n=n) * kernel, n=n).real
  return weighted[:, g:2 * g] / np.maximum(total[:, g:2 * g], 1e-8)


def replay_query_mask(settings, remaining, block_mask, decoded, conf, importance, shifted, active):
  """on_step_end's query set, in its order, with loops (the official arrays hold the active rows only)."""
  b, g = remaining.shape
  t = importance.shape[1]
  p = t - g
  scores = conf * replay_density(~remaining, settings.sigma)
  bonus = scores[active].max() if settings.batch_max_bonus else scores.max(-1, keepdims=True)
  scores = np.where(block_mask, scores + bonus, scores)
  selected = np.zeros((b, g), bool)
  for row in range(b):
    running = np.cumsum(remaining[row])
    hits = np.nonzero(running >= settings.current_k)[0]
    min_end = hits[0] if len(hits) else g - 1
    size = block_mask[row].sum()
    end = (min_end // size + 1) * size - 1
    start = np.argmax(block_mask[row])
    values = np.array([scores[row, i] if start <= i <= end and remaining[row, i] else -np.inf for i in range(g)])
    for i in np.argsort(-values, kind="stable")[:min(settings.current_k, g)]:
      selected[row, i] = remaining[row, i]
  response = np.concatenate([selected[:, 1:], np.zeros((b, 1), bool)], 1) if shifted else selected.copy()
  response |= decoded
  q = np.concatenate([np.zeros((b, p), bool), response], 1)
  for row in range(b):
    share = np.where(~q[row], importance[row], 0.0)
    share = share / (share.sum() + 1e-9)
    order = np.argsort(-share, kind="stable")
    running = 0.0
    add = np.zeros(t, bool)
    for rank, i in enumerate(order):
      running += share[i]
      if (running <= settings.rollout_p or rank == 0) and not q[row, i]:
        add[i] = True
    q[row] |= add
  if shifted:
    q[:, p - 1] = selected[:, 0]
  if settings.inflate_w > 0:
    grown = q.copy()
    for row in range(b):
      picks = np.nonzero(q[row])[0]
      for i in range(t):
        before, after = picks[picks <= i], picks[picks >= i]
        if len(before) and len(after) and after[0] - before[-1] <= settings.inflate_w:
          grown[row, i] = True
    q = grown
  return q, scores


@functools.lru_cache(maxsize=None)
def query_fn(settings, shifted):
  return jax.jit(functools.partial(d2cache.query_mask, settings, shifted=shifted))


def canvas(rng, b, p, g, block, block_index):
  """A semi-AR state: blocks before block_index decoded, the current block partly, later blocks masked."""
  start = block * block_index
  remaining = np.zeros((b, g), bool)
  remaining[:, start + block:] = True
  remaining[:, start:start + block] = rng.random((b, block)) < 0.6
  remaining[:, start] = True
  decoded = ~remaining & (rng.random((b, g)) < 0.5)
  block_mask = np.zeros((b, g), bool)
  block_mask[:, start:start + block] = True
  conf = rng.uniform(0.05, 1.0, size=(b, g))
  importance = rng.uniform(0.1, 3.0, size=(b, p + g))
  return remaining, block_mask, decoded, conf, importance


@pytest.mark.parametrize("settings, shifted", [
    (D2CacheSettings(current_k=3, rollout_p=0.3, sigma=2.0), False),
    (D2CacheSettings(current_k=5, rollout_p=0.15, sigma=4.0, inflate_w=3, batch_max_bonus=False), True),
])
def test_query_mask_matches_replay(settings, shifted):
  """LLaDA with the official batch-wide bonus; Dream (shift, last prompt position SET) with inflation and the
  per-row bonus."""
  rng = np.random.default_rng(1 + settings.current_k + shifted)
  for block, block_index in ((4, 1), (12, 0)):
    state = canvas(rng, 3, 5, 12, block, block_index)
    state[3][1] *= 3.0                          # row 1 holds the batch's largest score
    for active in (np.array([True, True, True]), np.array([True, False, True])):
      got_q, got_scores = query_fn(settings, shifted)(
          remaining=jnp.asarray(state[0]), block_mask=jnp.asarray(state[1]), decoded=jnp.asarray(state[2]),
          conf_cache=jnp.asarray(state[3], jnp.float32), importance=jnp.asarray(state[4], jnp.float32),
          active=jnp.asarray(active))
      want_q, want_scores = replay_query_mask(settings, *state, shifted, active)
      # inactive rows are not part of the official arrays: compared on the active rows
      np.testing.assert_allclose(np.asarray(got_scores)[active], want_scores[active], rtol=1e-5, atol=1e-6)
      np.testing.assert_array_equal(np.asarray(got_q)[active], want_q[active])


def replay_top_up(q, importance, density, active):
  q = q.copy()
  act = np.nonzero(active)[0]
  sub = q[act]
  counts = sub.sum(-1)
  if np.all(counts == counts.max()):
    return q
  combined = np.where(sub, -np.inf, importance[act])
  g = density.shape[1]
  combined[:, -g:] += combined.max() + density[act]
  for j, row in enumerate(act):
    need = counts.max() - counts[j]
    for i in np.argsort(-combined[j], kind="stable")[:need]:
      q[row, i] = True
  return q


def test_top_up_matches_replay():
  rng = np.random.default_rng(5)
  b, t, g = 4, 11, 7
  q = rng.random((b, t)) < 0.3
  q[0, :6] = True
  importance = rng.uniform(0.1, 2.0, (b, t))
  density = rng.uniform(0.0, 1.0, (b, g))
  active = np.array([True, True, False, True])
  got = jax.jit(d2cache.top_up)(jnp.asarray(q), jnp.asarray(importance, jnp.float32),
                                jnp.asarray(density, jnp.float32), jnp.asarray(active))
  np.testing.assert_array_equal(np.asarray(got), replay_top_up(q, importance, density, active))


def test_confidence_cache_frozen_both_ways():
  cache = jnp.array([[0.1, 0.2, 0.3]])
  new = jnp.array([[0.9, 0.8, 0.7]])
  computed = jnp.array([[True, True, False]])
  masked = jnp.array([[True, False, True]])
  assert np.array_equal(d2cache.update_confidence_cache(cache, new, computed, masked, True), cache)
  np.testing.assert_allclose(d2cache.update_confidence_cache(cache, new, computed, masked, False),
                             [[0.9, 0.2, 0.3]])


def test_index_set_ascending_padded_with_overflow():
  mask = np.array([[False, True, False, True, True], [False] * 5, [True] * 5])
  to_index_set = jax.jit(mask_to_index_set, static_argnums=1)
  idx, valid, overflow = to_index_set(jnp.asarray(mask), 3)
  np.testing.assert_array_equal(idx, [[1, 3, 4], [0, 0, 0], [0, 1, 2]])
  np.testing.assert_array_equal(valid, [[True] * 3, [False] * 3, [True] * 3])
  np.testing.assert_array_equal(overflow, [0, 0, 2])
  idx, valid, _ = to_index_set(jnp.asarray(mask[:1]), 7)
  np.testing.assert_array_equal(idx, [[1, 3, 4, 4, 4, 4, 4]])
  assert int(valid.sum()) == 3


@pytest.mark.parametrize("knobs, message", [
    ({"rollout_p": 0.0}, "d2cache rollout_p must be a number in (0, 1]"),
    ({"rollout_p": 1.5}, "d2cache rollout_p must be a number in (0, 1]"),
    ({"current_k": 0}, "d2cache current_k must be an int >= 1"),
    ({"sigma": 0.0}, "d2cache sigma must be a number > 0"),
    ({"inflate_w": -1}, "d2cache inflate_w must be an int >= 0"),
    ({"frozen_confidence": 1}, "d2cache frozen_confidence must be True or False"),
    ({"query_budget": 0}, "d2cache query_budget must be None or an int >= 1"),
])
def test_bad_knobs_refused_in_one_line(knobs, message):
  with pytest.raises(ValueError) as error:
    D2CacheSettings(**knobs)
  assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_published_values_and_refusals():
  assert D2CacheSettings.published("dream", "humaneval") == D2CacheSettings(
      rollout_p=0.1, current_k=32, sigma=10.0, inflate_w=0)
  assert D2CacheSettings.NAME == "d2cache" and D2CacheSettings().frozen_confidence
  with pytest.raises(ValueError, match="d2cache published family"):
    D2CacheSettings.published("gpt2")
  with pytest.raises(ValueError, match="d2cache published task"):
    D2CacheSettings.published("llada", "lambada")
