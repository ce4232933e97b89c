"""Every sink metric of dlm_jax.analysis.sinks against a brute-force NumPy loop on random attention maps."""

import collections

import jax
import numpy as np
import pytest

from dlm_jax.analysis import sinks
from dlm_jax.instrument import sink_selection

jax.config.update("jax_default_matmul_precision", "highest")


def random_column_sums(rng, lead, s, n_sinks=2, boost=4.0):
  """Column sums [*lead, s] of random row-softmax maps [*lead, s, s] with a few boosted sink columns."""
  logits = rng.normal(size=(*lead, s, s))
  for index in np.ndindex(*lead):
    logits[index][:, rng.choice(s, n_sinks, replace=False)] += boost * rng.random()
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  return probs.sum(-2).astype(np.float32)


def brute_epsilon(c, eps, normalise="sum", valid=None, n_queries=None):
  """Loops over keys: c_j > mean of the other valid keys + eps, on normalised scores."""
  s = c.shape[-1]
  out = np.zeros(c.shape, bool)
  for index in np.ndindex(*c.shape[:-1]):
    row = c[index].astype(np.float64)
    v = np.ones(s, bool) if valid is None else np.asarray(valid)[index]
    keys = [j for j in range(s) if v[j]]
    if normalise == "mean":
      row = row / (s if n_queries is None else n_queries)
    elif normalise == "zscore":
      mu = np.mean([row[j] for j in keys])
      sd = np.sqrt(np.mean([(row[j] - mu) ** 2 for j in keys]))
      row = (row - mu) / sd if sd > 0 else np.zeros(s)
    for j in keys:
      others = [row[k] for k in keys if k != j]
      out[index + (j,)] = bool(others) and row[j] > np.mean(others) + eps
  return out


def brute_topk(c, k, candidates=None):
  out = np.zeros(c.shape, bool)
  for index in np.ndindex(*c.shape[:-1]):
    cand = [j for j in range(c.shape[-1]) if candidates is None or candidates[index][j]]
    kk = k if np.isscalar(k) else k[index]
    chosen = sorted(cand, key=lambda j: (-c[index][j], j))[:kk]
    out[index + (np.array(chosen, int),)] = True
  return out


@pytest.mark.parametrize("normalise,eps", [("sum", 3.0), ("sum", 0.5), ("mean", 0.05), ("zscore", 1.5)])
def test_epsilon_rule_matches_brute_force(normalise, eps):
  rng = np.random.default_rng(0)
  c = random_column_sums(rng, (3, 4), 16)
  valid = rng.random((3, 4, 16)) > 0.2
  for v in (None, valid):
    got = np.asarray(sink_selection.epsilon_rule(c, eps, normalise, valid=v))
    np.testing.assert_array_equal(got, brute_epsilon(c, eps, normalise, v))
  assert brute_epsilon(c, eps, normalise).any()  # the test exercises both outcomes


def test_epsilon_rule_column_sums_filter_most_tokens():
  rng = np.random.default_rng(1)
  c = random_column_sums(rng, (8,), 64, n_sinks=1, boost=8.0)
  assert np.isclose(c.mean(), 1.0, atol=1e-5)  # column sums of a full map average 1
  assert 1 - np.asarray(sink_selection.epsilon_rule(c)).mean() >= 0.96


def test_top_k_with_ties_prefers_lower_position():
  c = np.array([[1.0, 5.0, 5.0, 0.0, 5.0, 2.0]], np.float32)
  np.testing.assert_array_equal(np.asarray(sink_selection.top_k_mask(c, 2)), [[0, 1, 1, 0, 0, 0]])
  np.testing.assert_array_equal(np.asarray(sink_selection.top_k_positions(c, 4)), [[1, 2, 4, 5]])
  np.testing.assert_array_equal(np.asarray(sink_selection.sink_ranks(c)), [[4, 0, 1, 5, 2, 3]])


def test_top_k_and_top_k_sinks_match_brute_force():
  rng = np.random.default_rng(2)
  c = random_column_sums(rng, (2, 3), 12)
  c[0, 0, 3] = c[0, 0, 7]  # a tie
  k = rng.integers(0, 6, size=(2, 3))
  cand = rng.random((2, 3, 12)) > 0.3
  np.testing.assert_array_equal(np.asarray(sink_selection.top_k_mask(c, k, cand)), brute_topk(c, k, cand))
  np.testing.assert_array_equal(np.asarray(sink_selection.top_k_mask(c, 3)), brute_topk(c, 3))
  got = np.asarray(sink_selection.top_k_sinks(c, 3, eps=1.0))
  np.testing.assert_array_equal(got, brute_topk(c, 3) & brute_epsilon(c, 1.0))
  positions = np.asarray(sink_selection.top_k_positions(c, 4, cand))
  for index in np.ndindex(2, 3):
    expected = sorted([j for j in range(12) if cand[index][j]], key=lambda j: (-c[index][j], j))[:4]
    np.testing.assert_array_equal(positions[index], expected + [-1] * (4 - len(expected)))


@pytest.mark.parametrize("causal", [False, True])
def test_gu_sink_ratio_matches_brute_force(causal):
  rng = np.random.default_rng(3)
  layers, heads, s = 3, 4, 10
  logits = rng.normal(size=(layers, heads, s, s)) + 3.0 * (np.arange(s) == 0)
  if causal:
    logits = np.where(np.tril(np.ones((s, s), bool)), logits, -np.inf)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  expected = np.zeros(s)
  for k in range(s):
    hits = 0
    for l in range(layers):
      for h in range(heads):
        queries = range(k, s) if causal else range(s)
        alpha = np.mean([probs[l, h, t, k] for t in queries])
        hits += alpha > 0.3
    expected[k] = hits / (layers * heads)
  got = np.asarray(sinks.gu_sink_ratio(probs.sum(-2), eps=0.3, causal=causal))
  np.testing.assert_allclose(got, expected, atol=1e-6)
  assert expected[0] > 0


def test_sink_sets_per_step():
  rng = np.random.default_rng(4)
  mask = rng.random((5, 9)) > 0.7
  sets = sinks.sink_sets_per_step(mask)
  assert sets == [{(j,) for j in range(9) if mask[t, j]} for t in range(5)]
  mask3 = rng.random((4, 2, 6)) > 0.7
  sets3 = sinks.sink_sets_per_step(mask3)
  assert sets3 == [{(h, j) for h in range(2) for j in range(6) if mask3[t, h, j]} for t in range(4)]


def brute_trajectory(c, eps):
  """Largest sink per step and moving-sink measures with explicit loops; c: [steps, S]."""
  steps, s = c.shape
  is_sink = brute_epsilon(c, eps)
  positions = []
  for t in range(steps):
    found = [j for j in range(s) if is_sink[t, j]]
    positions.append(max(found, key=lambda j: (c[t, j], -j)) if found else -1)
  pairs = [(positions[t - 1], positions[t]) for t in range(1, steps) if positions[t - 1] >= 0 and positions[t] >= 0]
  change = np.mean([a != b for a, b in pairs]) if pairs else np.nan
  drift = np.mean([abs(b - a) for a, b in pairs]) if pairs else np.nan
  signed = np.mean([b - a for a, b in pairs]) if pairs else np.nan
  lifetimes = []
  for j in range(s):
    run = 0
    for t in range(steps):
      if is_sink[t, j]:
        run += 1
      elif run:
        lifetimes.append(run)
        run = 0
    if run:
      lifetimes.append(run)
  centroids = []
  for t in range(steps):
    found = [j for j in range(s) if is_sink[t, j]]
    if found:
      centroids.append(sum(c[t, j] * j for j in found) / sum(c[t, j] for j in found))
  return dict(positions=positions, change=change, drift=drift, signed=signed, lifetimes=lifetimes,
              centroid_variance=np.var(centroids) if centroids else np.nan,
              steps_with_sink=sum(p >= 0 for p in positions))


def test_moving_sink_measures_match_brute_force():
  rng = np.random.default_rng(5)
  steps, s = 12, 20
  c = random_column_sums(rng, (steps,), s, n_sinks=2, boost=6.0)
  expected = brute_trajectory(c, 3.0)
  positions = np.asarray(sinks.largest_sink_positions(c, 3.0))
  np.testing.assert_array_equal(positions, expected["positions"])
  np.testing.assert_allclose(sinks.largest_sink_change_rate(positions), expected["change"])
  np.testing.assert_allclose(sinks.largest_sink_drift(positions), expected["drift"])
  np.testing.assert_allclose(sinks.largest_sink_drift(positions, signed=True), expected["signed"])
  lifetimes = sinks.sink_lifetimes(np.asarray(sink_selection.epsilon_rule(c, 3.0)))
  assert sorted(lifetimes.tolist()) == sorted(expected["lifetimes"])
  summary = sinks.moving_sink_summary(c, 3.0)
  np.testing.assert_allclose(summary["change_rate"], expected["change"])
  np.testing.assert_allclose(summary["drift"], expected["drift"])
  np.testing.assert_allclose(summary["mean_lifetime"], np.mean(expected["lifetimes"]))
  np.testing.assert_allclose(summary["centroid_variance"], expected["centroid_variance"], rtol=1e-5)
  assert summary["steps_with_sink"] == expected["steps_with_sink"]
  assert expected["steps_with_sink"] > 1 and len(expected["lifetimes"]) > 1


def test_moving_sink_measures_on_handmade_trajectory():
  positions = np.array([3, 3, 5, -1, 5, 2, 2])
  # defined pairs: (3,3) (3,5) (5,2) (2,2) -> 2 changes of 4; |Δ| 0,2,3,0; signed 0,2,-3,0
  assert sinks.largest_sink_change_rate(positions) == 0.5
  assert sinks.largest_sink_drift(positions) == 1.25
  assert sinks.largest_sink_drift(positions, signed=True) == -0.25
  assert np.isnan(sinks.largest_sink_change_rate(np.array([1, -1, 2])))
  mask = np.zeros((6, 4), bool)
  mask[[0, 1, 2, 4, 5], 1] = True
  mask[[5], 3] = True
  assert sinks.sink_lifetimes(mask).tolist() == [3, 2, 1]
  # several series: [steps, heads, S]
  mask2 = np.stack([mask, ~mask], axis=1)
  lifetimes = sinks.sink_lifetimes(mask2)
  assert sorted(lifetimes.tolist()) == sorted([3, 2, 1] + [6, 1, 6, 5])


def test_sink_token_counts_match_brute_force():
  rng = np.random.default_rng(6)
  steps, layers, batch, heads, s = 3, 2, 2, 3, 8
  mask = rng.random((steps, layers, batch, heads, s)) > 0.8
  tokens = rng.integers(0, 5, size=(steps, batch, s))
  counts = sinks.sink_token_counts(mask, tokens[:, None, :, None, :])
  expected = collections.Counter()
  for t, l, b, h, j in np.ndindex(*mask.shape):
    if mask[t, l, b, h, j]:
      expected[int(tokens[t, b, j])] += 1
  assert counts == expected
  freqs = sinks.relative_frequencies(counts)
  assert np.isclose(sum(freqs.values()), 1.0)
  assert list(freqs.values()) == sorted(freqs.values(), reverse=True)


def test_value_norm_summary_matches_brute_force():
  rng = np.random.default_rng(7)
  layers, batch, kv, heads, s = 2, 2, 2, 4, 6
  norms = rng.random((layers, batch, kv, s)) * 5
  per_head = rng.random((layers, batch, heads, s)) > 0.7
  valid = rng.random((batch, s)) > 0.2
  sink_vals, normal_vals = [], []
  for l, b, n, j in np.ndindex(layers, batch, heads, s):
    if valid[b, j]:
      (sink_vals if per_head[l, b, n, j] else normal_vals).append(norms[l, b, n // (heads // kv), j])
  got = sinks.value_norm_summary(norms, per_head, valid)
  np.testing.assert_allclose([got["sink_mean"], got["normal_mean"], got["sink_std"], got["normal_std"]],
                             [np.mean(sink_vals), np.mean(normal_vals), np.std(sink_vals), np.std(normal_vals)])
  assert (got["sink_count"], got["normal_count"]) == (len(sink_vals), len(normal_vals))
  per_layer = per_head.any(2)
  sink_vals, normal_vals = [], []
  for l, b, j in np.ndindex(layers, batch, s):
    r = np.mean([norms[l, b, h, j] for h in range(kv)])
    (sink_vals if per_layer[l, b, j] else normal_vals).append(r)
  got = sinks.value_norm_summary(norms, per_layer, per_head=False)
  np.testing.assert_allclose([got["sink_mean"], got["normal_mean"]], [np.mean(sink_vals), np.mean(normal_vals)])
