"""The statistics planner (`dlm_jax.sampling.stats_plan.StatsPlan`) on its own: every consumer's view derived from the one
merged forward equals that consumer's statistic computed directly from attention probabilities in NumPy.

A random probability tensor p [L, B, N, T, S] stands for the attention of one model call. The merged
forward's output is built from p exactly as `StatsSpec` defines it (weighted column sums per query group,
layer subset, head mean), so what is under test is the planning: the union of the consumers (layers,
heads, query-group spans, the "all real queries" span under padding), and `derive` / `user_stats` /
`intervention_output` / `top_sinks` slicing it back. The reference views are written from each consumer's
definition (`StatsPlan`'s docstring), never through the planner. The forward itself is checked against
`transformers` in test_model_parity.py.
"""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from dlm_jax.instrument.stats import NO_STATS, ForwardOutput, StatsSpec, merge_specs
from dlm_jax.sampling.stats_plan import StatsPlan

L, B, N, K, T = 3, 2, 4, 2, 6
PAD = 2  # row 1's first PAD positions are padding when the batch is padded
RNG = np.random.default_rng(0)
PROBS = RNG.dirichlet(np.ones(T), size=(L, B, N, T))  # [L, B, N, T, S], rows sum to 1
VALUE_NORMS = RNG.random((L, B, K, T))
SAMPLER_GROUP = RNG.integers(0, 3, (B, T))  # each query's sampler group (masked / unmasked / prompt)
SAMPLER_WEIGHTS = np.stack([SAMPLER_GROUP == g for g in range(3)], axis=1).astype(np.float32)  # [B, 3, T]
INTERVENTION_WEIGHTS = RNG.random((B, 2, T)).astype(np.float32)  # an intervention's own two groups

USERS = {
    "none": NO_STATS,
    "all layers per head": StatsSpec(incoming_attention=True),
    "grouped, head mean, layers (2, 0)": StatsSpec(incoming_attention=True, per_head=False, layers=(2, 0),
                                                   query_groups=3),
    "head mean, layer 1, value norms": StatsSpec(incoming_attention=True, per_head=False, layers=(1,),
                                                 value_norms=True),
    "value norms only, layers (0, 2)": StatsSpec(value_norms=True, layers=(0, 2)),
}
INTERVENTIONS = {
    "none": NO_STATS,
    "layer 0 per head": StatsSpec(incoming_attention=True, layers=(0,)),
    "two own groups, layers (1, 2)": StatsSpec(incoming_attention=True, layers=(1, 2), query_groups=2),
}


def _valid(padded: bool) -> np.ndarray:
  """[B, T] real queries / keys."""
  valid = np.ones((B, T), bool)
  if padded:
    valid[1, :PAD] = False
  return valid


def _incoming(weights: np.ndarray, layers, per_head: bool) -> np.ndarray:
  """Weighted column sums of PROBS: weights [B, Q, T] -> [L', B, Q, N', S]."""
  out = np.einsum("bqt,lbnts->lbqns", weights, PROBS)
  out = out[list(range(L)) if layers is None else list(layers)]
  return out if per_head else out.mean(axis=3, keepdims=True)


def _merged_forward(plan: StatsPlan, padded: bool) -> ForwardOutput:
  """What the forward returns under `plan.forward_spec` with `plan.query_weights`."""
  spec = plan.forward_spec
  layers = list(range(L)) if spec.layers is None else list(spec.layers)
  stats = {}
  if spec.incoming_attention:
    weights = plan.query_weights(lambda: jnp.asarray(SAMPLER_WEIGHTS), lambda: jnp.asarray(INTERVENTION_WEIGHTS),
                                 jnp.asarray(_valid(padded)))
    weights = np.ones((B, 1, T), np.float32) if weights is None else np.asarray(weights)
    stats["incoming_attention"] = jnp.asarray(_incoming(weights, spec.layers, spec.per_head))
  if spec.value_norms:
    stats["value_norms"] = jnp.asarray(VALUE_NORMS[layers])
  return ForwardOutput(logits=None, stats=stats)


def _expected_incoming(spec: StatsSpec, role: str, padded: bool) -> np.ndarray:
  """A consumer's incoming attention from its definition: the user's groups count real queries only; an
  intervention's groups are its own weights; an ungrouped view sums over the real queries (all queries
  when the batch is not padded)."""
  real = _valid(padded).astype(np.float32)[:, None, :]
  if spec.query_groups:
    weights = SAMPLER_WEIGHTS * real if role == "user" else INTERVENTION_WEIGHTS
  else:
    weights = real
  return _incoming(weights, spec.layers, spec.per_head)


CASES = list(itertools.product(USERS, INTERVENTIONS, [False, True], [0, 2]))


@pytest.mark.parametrize("user, intervention, padded, sink_top_k", CASES)
def test_each_consumer_reads_its_own_statistic(user, intervention, padded, sink_top_k):
  plan = StatsPlan(user=USERS[user], intervention=INTERVENTIONS[intervention], sink_top_k=sink_top_k,
                   padded=padded)
  plan.check(L)
  output = _merged_forward(plan, padded)

  stats = plan.user_stats(output)
  if not plan.user.enabled:
    assert stats is None
  else:
    assert set(stats) == {name for name, on in (("incoming_attention", plan.user.incoming_attention),
                                                 ("value_norms", plan.user.value_norms)) if on}
    if plan.user.incoming_attention:
      np.testing.assert_allclose(stats["incoming_attention"], _expected_incoming(plan.user, "user", padded),
                                 rtol=1e-6, atol=1e-6)
    if plan.user.value_norms:
      layers = list(range(L)) if plan.user.layers is None else list(plan.user.layers)
      np.testing.assert_array_equal(stats["value_norms"], VALUE_NORMS[layers].astype(np.float32))

  seen = plan.intervention_output(output)
  if plan.intervention.incoming_attention:
    np.testing.assert_allclose(seen.incoming_attention,
                               _expected_incoming(plan.intervention, "intervention", padded), rtol=1e-6, atol=1e-6)
  else:
    assert seen.incoming_attention is None

  sinks = plan.top_sinks(output, jnp.asarray(_valid(padded)))
  if not sink_top_k:
    assert sinks is None
    return
  # the top sinks: over every real query, the user's layers and head choice (every layer, per head without one)
  source = plan.user if plan.user.incoming_attention else StatsSpec(incoming_attention=True)
  scores = _expected_incoming(StatsSpec(incoming_attention=True, per_head=source.per_head, layers=source.layers),
                              "user", padded)[:, :, 0]  # [L', B, N', S]
  scores = np.where(_valid(padded)[None, :, None, :], scores, -np.inf)
  expected = np.argsort(-scores, axis=-1, kind="stable")[..., :sink_top_k]
  np.testing.assert_array_equal(sinks, expected)
  assert not np.isin(np.asarray(sinks)[:, 1], np.arange(PAD)).any() or not padded  # pad keys never chosen


def test_forward_spec_is_the_union_and_nothing_when_nobody_asks():
  assert StatsPlan().forward_spec == NO_STATS
  plan = StatsPlan(user=USERS["grouped, head mean, layers (2, 0)"],
                   intervention=INTERVENTIONS["two own groups, layers (1, 2)"], sink_top_k=1, padded=True)
  spec = plan.forward_spec
  # per head because the sinks (user's layers, per user's head choice = mean) ... and the intervention needs heads
  assert spec.per_head and spec.layers == (0, 1, 2)
  # the sampler's 3 groups give the sum over real queries; the intervention's 2 groups follow: no "all" span
  assert plan.group_spans == (("sampler", 3), ("intervention", 2)) and spec.query_groups == 5
  # ungrouped consumers of a padded batch need the span of real queries
  padded_only = StatsPlan(user=USERS["all layers per head"], padded=True)
  assert padded_only.group_spans == (("all", 1),) and padded_only.forward_spec.query_groups == 1
  assert StatsPlan(user=USERS["all layers per head"]).group_spans == ()


def test_planner_errors():
  with pytest.raises(ValueError, match="query_groups 0 or 3"):
    StatsPlan(user=StatsSpec(incoming_attention=True, query_groups=2))
  with pytest.raises(ValueError, match="sink_top_k"):
    StatsPlan(sink_top_k=-1)
  with pytest.raises(ValueError, match="beyond the model"):
    StatsPlan(user=StatsSpec(incoming_attention=True, layers=(5,))).check(L)
  with pytest.raises(ValueError, match="Incompatible"):
    merge_specs(StatsSpec(incoming_attention=True, layers=(0,)), StatsSpec(incoming_attention=True, layers=(1,)))
  assert merge_specs(StatsSpec(value_norms=True), StatsSpec(incoming_attention=True)) == StatsSpec(
      incoming_attention=True, value_norms=True)
