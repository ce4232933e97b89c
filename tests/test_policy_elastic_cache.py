"""Elastic-Cache's decision functions against NumPy replays of the official code (yxu-dev/Elastic-Cache
`llada/model/modeling_llada.py` `LLaDABlock.attention`: tracked token and drift; `llada/generate.py`
`generate_with_elastic_cache` / `get_decoded_token_confident` / `get_decoded_token_topk`: query positions,
decoding, EOS cut), written here with the official index arrays (masked_position, query_position) and loops."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlm_jax.policy import elastic_cache as ec
from dlm_jax.policy.elastic_cache import ElasticCacheSettings

jax.config.update("jax_default_matmul_precision", "highest")


def softmax(x):
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


@functools.lru_cache(maxsize=None)
def drift_fn():
  def drift(q_prev, k_prev, q_now, k_now, row_valid, key_valid, track_rows, pending, similarities):
    previous = ec.attention_rows(q_prev, k_prev, key_valid)
    sim = ec.drift_similarity(previous, ec.attention_rows(q_now, k_now, key_valid), row_valid, key_valid)
    tracked = jax.vmap(lambda rows: ec.track_tokens(rows, pending, 2))(track_rows)
    return sim, tracked, ec.tracked_mask(tracked, pending.shape[-1]), ec.refresh_start(similarities, 0.9)
  return jax.jit(drift)


def test_tracking_drift_and_refresh_start_match_replay():
  rng = np.random.default_rng(0)
  b, t, s, n, kv, h, n_layers = 2, 3, 10, 4, 2, 8, 3
  q_prev, q_now = rng.normal(size=(2, b, t, n, h))
  k_prev = rng.normal(size=(b, s, kv, h))
  k_now = k_prev + rng.normal(size=(b, s, kv, h)) * 0.7
  row_valid = np.array([[True, True, True], [True, False, True]])
  key_valid = np.ones((b, s), bool)
  key_valid[1, :2] = False                                   # row 1 left-padded by two: those keys left out
  track_rows = rng.uniform(0.0, 1.0, size=(n_layers, b, n, s))
  pending = rng.random((b, s)) < 0.4
  similarities = np.array([[0.95, 0.99], [0.85, 0.97], [0.5, 0.91]])
  floats = (jnp.asarray(x, jnp.float32) for x in (q_prev, k_prev, q_now, k_now))
  sim, tracked, union, start = drift_fn()(
      *floats, jnp.asarray(row_valid), jnp.asarray(key_valid), jnp.asarray(track_rows, jnp.float32),
      jnp.asarray(pending), jnp.asarray(similarities, jnp.float32))
  for row in range(b):
    keep, keys = np.nonzero(row_valid[row])[0], np.nonzero(key_valid[row])[0]
    heads = np.arange(n) // (n // kv)                      # repeat_interleave of the key heads
    past = softmax(np.einsum("tnh,snh->nts", q_prev[row][keep], k_prev[row][keys][:, heads]) / np.sqrt(h))
    now = softmax(np.einsum("tnh,snh->nts", q_now[row][keep], k_now[row][keys][:, heads]) / np.sqrt(h))
    cosine = (past * now).sum(0) / np.maximum(np.linalg.norm(past, axis=0) * np.linalg.norm(now, axis=0), 1e-8)
    np.testing.assert_allclose(float(sim[row]), cosine.mean(), rtol=1e-5)
    ids = set()
    for layer in range(n_layers):
      score = track_rows[layer, row].sum(0)
      score[pending[row]] = 0.0
      top = set(np.argsort(-score, kind="stable")[:2].tolist())
      assert set(np.asarray(tracked[layer, row]).tolist()) == top
      ids |= top
    assert set(np.nonzero(np.asarray(union[row]))[0].tolist()) == ids
    start_reset = n_layers                                  # the official lengths[1] after the layer loop
    for layer in range(n_layers):
      if layer < start_reset and similarities[layer, row] < 0.9:
        start_reset = layer + 1
    assert int(start[row]) == start_reset


def replay_call(settings, track_position, new_decoded_position, masked_position, shifted):
  """The official query_position and decoding window of a call after the first (LLaDA's generate; Dream's
  _sample queries masked_position − 1)."""
  query_masked_position = masked_position[:settings.window_length] if settings.block_caching else masked_position
  if shifted:
    query_masked_position = query_masked_position - 1
  query_position = np.concatenate([track_position, new_decoded_position, query_masked_position])
  return query_position, masked_position[:settings.window_length]


@functools.lru_cache(maxsize=None)
def query_fn(settings, shifted=False):
  return jax.jit(functools.partial(ec.query_mask, settings, shifted=shifted))


@pytest.mark.parametrize("block_caching, shifted", [(True, False), (False, False), (True, True)])
def test_query_set_and_window_match_replay(block_caching, shifted):
  settings = ElasticCacheSettings(window_length=3, block_caching=block_caching)
  s = 14
  masked_position = np.array([6, 7, 9, 10, 12, 13])
  track_position = np.array([1, 4])
  new_decoded_position = np.array([8, 11])
  queries, window = query_fn(settings, shifted)(
      jnp.zeros((1, s), bool).at[0, track_position].set(True),
      jnp.zeros((1, s), bool).at[0, new_decoded_position].set(True),
      jnp.zeros((1, s), bool).at[0, masked_position].set(True))
  query_position, window_position = replay_call(settings, track_position, new_decoded_position, masked_position,
                                                shifted)
  np.testing.assert_array_equal(np.nonzero(np.asarray(queries[0]))[0], np.unique(query_position))
  np.testing.assert_array_equal(np.nonzero(np.asarray(window[0]))[0], window_position)


def test_query_budget_is_the_largest_query_set():
  """Worst case with block caching: every layer tracks different tokens, the whole window was decoded."""
  settings = ElasticCacheSettings(window_length=3, track_num=2)
  n_layers, s = 2, 14
  assert settings.query_budget(n_layers, s) == 10 and settings.query_budget(n_layers, 8) == 8
  assert ElasticCacheSettings(block_caching=False).query_budget(n_layers, s) == s
  tracked = jnp.zeros((1, s), bool).at[0, :4].set(True)
  decoded = jnp.zeros((1, s), bool).at[0, 5:8].set(True)
  pending = jnp.zeros((1, s), bool).at[0, 8:].set(True)
  queries, _ = query_fn(ElasticCacheSettings(window_length=3), False)(tracked, decoded, pending)  # no track_num
  assert int(queries.sum()) == settings.query_budget(n_layers, s)


def replay_decode(settings, probabilities, window_position):
  """get_decoded_token_confident / get_decoded_token_topk on the window's top probabilities."""
  x0_p = probabilities[window_position]
  if settings.threshold is not None:
    return window_position[x0_p >= min(settings.threshold, x0_p.max())]
  return window_position[np.argsort(-x0_p, kind="stable")[:min(settings.tokens_per_iter, len(x0_p))]]


@pytest.mark.parametrize("settings", [ElasticCacheSettings(threshold=0.6),
                                      ElasticCacheSettings(threshold=None, tokens_per_iter=2)])
def test_commit_and_eos_cut_replay_a_decoding_run(settings):
  """A run of calls with given top probabilities and tokens: committed positions, the EOS cut (set once, at
  the first call that decodes an EOS, never moved by later EOS) and the pending set, call by call."""
  rng = np.random.default_rng(2)
  s, prompt, eos = 16, 3, 99
  commit_fn = jax.jit(functools.partial(ec.commit, settings))
  cut_fn = jax.jit(ec.update_eos_cut)
  pending_fn = jax.jit(ec.pending_mask)
  masked_position = np.arange(prompt, s)
  still_masked = np.zeros(s, bool)
  still_masked[prompt:] = True
  eos_cut = jnp.array([s], jnp.int32)
  decoded_eos = False
  for call in range(20):
    probabilities = rng.uniform(0.2, 0.8, s)
    tokens = np.where(rng.random(s) < 0.25, eos, 5)
    window_position = masked_position[:settings.window_length]
    want = replay_decode(settings, probabilities, window_position)
    pending = pending_fn(jnp.asarray(still_masked)[None], eos_cut)
    _, window = ec.query_mask(settings, jnp.zeros((1, s), bool), jnp.zeros((1, s), bool), pending)
    got = commit_fn(jnp.asarray(probabilities, jnp.float32)[None], window)
    np.testing.assert_array_equal(np.nonzero(np.asarray(got[0]))[0], np.sort(want))
    masked_position = masked_position[~np.isin(masked_position, want)]
    eos_pos = want[tokens[want] == eos]
    if not decoded_eos and len(eos_pos):
      decoded_eos = True
      masked_position = masked_position[masked_position <= eos_pos.min()]
    still_masked[want] = False
    eos_cut = cut_fn(eos_cut, got, jnp.asarray(tokens == eos)[None])
    pending = pending_fn(jnp.asarray(still_masked)[None], eos_cut)
    np.testing.assert_array_equal(np.nonzero(np.asarray(pending[0]))[0], masked_position)
    if len(masked_position) == 0:
      break
  assert decoded_eos and still_masked[int(eos_cut[0]) + 1:].any()   # masks after the cut are never decoded


@pytest.mark.parametrize("knobs, message", [
    ({"window_length": 0}, "elastic_cache window_length must be an int >= 1"),
    ({"track_num": 0}, "elastic_cache track_num must be an int >= 1"),
    ({"tokens_per_iter": 1.5}, "elastic_cache tokens_per_iter must be an int >= 1"),
    ({"gamma": 0.0}, "elastic_cache gamma must be a number in (0, 1]"),
    ({"gamma": 1.2}, "elastic_cache gamma must be a number in (0, 1]"),
    ({"threshold": 0.0}, "elastic_cache threshold must be None or a number in (0, 1]"),
    ({"block_caching": 1}, "elastic_cache block_caching must be True or False"),
])
def test_bad_knobs_refused_in_one_line(knobs, message):
  with pytest.raises(ValueError) as error:
    ElasticCacheSettings(**knobs)
  assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_published_values_and_refusals():
  assert ElasticCacheSettings.published("llada") == ElasticCacheSettings()
  assert ElasticCacheSettings.published("dream", "gsm8k").window_length == 32
  assert ElasticCacheSettings.published("dream", "humaneval").gamma == 0.98
  assert ElasticCacheSettings.published("mmada", "mbpp") == ElasticCacheSettings.published("llada", "mbpp")
  assert ElasticCacheSettings.NAME == "elastic_cache"
  with pytest.raises(ValueError, match="elastic_cache published family"):
    ElasticCacheSettings.published("gpt2")
  with pytest.raises(ValueError, match="elastic_cache published task for dream"):
    ElasticCacheSettings.published("dream", "mbpp")
