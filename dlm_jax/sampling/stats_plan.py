"""The statistics planner: one forward per sampler model call computes what every consumer of the step
needs (the user's spec, the intervention's required statistics, the per-step top-k sinks), and each
consumer's view is derived from it. Layouts are those of `dlm_jax.instrument.stats`."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from dlm_jax.instrument.stats import NO_STATS, QUERY_GROUP_NAMES, STATISTICS, ForwardOutput, StatsSpec, squeeze


def _per_group(spec: StatsSpec) -> bool:
  """The spec asks for a statistic with a query-group axis ("Q")."""
  return any("Q" in STATISTICS[name].axes for name in spec.names)


def _union_layers(specs: list[StatsSpec]) -> tuple[int, ...] | None:
  if any(s.layers is None for s in specs):
    return None
  return tuple(sorted(set().union(*(s.layers for s in specs))))


@dataclasses.dataclass(frozen=True)
class StatsPlan:
  """Static plan of the statistics one sampler model call computes, and who reads which part.

  A sampler step has up to three consumers: the user's spec, the intervention's `required_stats(config)`
  (with its own `query_weights` when it asks for query groups) and the per-step top-k sinks. The plan
  runs one forward with their union (heads if anyone needs heads, the union of the layers, the
  query-group spans of every consumer side by side) and derives each consumer's view from it.

  Attributes:
    user: the caller's spec (query_groups 0 or 3, `QUERY_GROUP_NAMES`).
    intervention: the intervention's `required_stats`.
    policy: the compute policy's `required_stats` (with its own query groups when it asks for them, like the
      intervention's).
    sink_top_k: k of the per-step top-k sinks (0 = off).
    padded: the batch is left-padded: the statistics of the user, the top sinks and an ungrouped
      intervention sum over the real queries only (pad queries are not part of any sequence; with them a
      row's statistics would depend on how much it is padded). An intervention's own query groups are
      used as it gives them.
    own_groups: the user's query groups are the caller's own (a plain forward given query weights, any
      number of groups) instead of a sampler's `QUERY_GROUP_NAMES`.

  The forward's query groups come in spans: "sampler" (the 3 groups, when the user asks for them),
  "all" (one group of every real query, when someone needs the sum over all queries and no sampler
  span gives it) and "intervention" (the intervention's groups). Without any grouped consumer and
  without padding the forward is ungrouped.
  """

  user: StatsSpec = NO_STATS
  intervention: StatsSpec = NO_STATS
  sink_top_k: int = 0
  padded: bool = False
  own_groups: bool = False
  policy: StatsSpec = NO_STATS

  def __post_init__(self):
    if not self.own_groups and self.user.query_groups not in (0, len(QUERY_GROUP_NAMES)):
      raise ValueError(f"Samplers support StatsSpec.query_groups 0 or {len(QUERY_GROUP_NAMES)} "
                       f"({', '.join(QUERY_GROUP_NAMES)}), got {self.user.query_groups}.")
    if isinstance(self.sink_top_k, bool) or not isinstance(self.sink_top_k, int) or self.sink_top_k < 0:
      raise ValueError(f"sink_top_k must be an integer >= 0, got {self.sink_top_k!r}.")

  @property
  def sinks_spec(self) -> StatsSpec:
    """Incoming attention the top-k sinks are taken from: the user's layers and head choice, all queries."""
    if not self.sink_top_k:
      return NO_STATS
    if self.user.incoming_attention:
      return StatsSpec(incoming_attention=True, per_head=self.user.per_head, layers=self.user.layers)
    return StatsSpec(incoming_attention=True, per_head=True)

  @property
  def _consumers(self) -> tuple[StatsSpec, ...]:
    return (self.user, self.intervention, self.sinks_spec, self.policy)

  @property
  def group_spans(self) -> tuple[tuple[str, int], ...]:
    """((name, size), ...) of the forward's query-group spans; () = ungrouped."""
    consumers = [s for s in self._consumers if _per_group(s)]
    spans = []
    if _per_group(self.user) and self.user.query_groups:
      spans.append(("sampler", self.user.query_groups))
    if _per_group(self.intervention) and self.intervention.query_groups:
      spans.append(("intervention", self.intervention.query_groups))
    if _per_group(self.policy) and self.policy.query_groups:
      spans.append(("policy", self.policy.query_groups))
    if ((spans or self.padded) and (not spans or spans[0][0] != "sampler" or self.own_groups)
        and any(not s.query_groups for s in consumers)):
      spans.insert(0, ("all", 1))
    return tuple(spans)

  def _span(self, name: str) -> slice:
    start = 0
    for span, size in self.group_spans:
      if span == name:
        return slice(start, start + size)
      start += size
    raise KeyError(name)

  @property
  def forward_spec(self) -> StatsSpec:
    """The one spec the forward pass is run with."""
    consumers = [s for s in self._consumers if s.enabled]
    if not consumers:
      return NO_STATS
    incoming = [s for s in consumers if s.incoming_attention]
    spec = StatsSpec(per_head=any(s.per_head for s in incoming) if incoming else True,
                     layers=_union_layers(consumers), query_groups=sum(size for _, size in self.group_spans))
    return spec.asking(set().union(*(s.names for s in consumers)))

  def check(self, n_layers: int) -> None:
    self.forward_spec.check_layers(n_layers)

  def query_weights(self, sampler_weights, intervention_weights, query_valid: jax.Array,
                    policy_weights=None) -> jax.Array | None:
    """[B, Q, T] weights of the forward's groups, from zero-argument callables giving the sampler's, the
    intervention's and the policy's spans; query_valid: [B, T] bool, the real queries (all True without
    padding)."""
    parts = []
    real = query_valid.astype(jnp.float32)[:, None, :]
    for name, _ in self.group_spans:
      if name == "sampler":
        parts.append(sampler_weights() * real)
      elif name == "intervention":
        weights = intervention_weights()
        if weights is None:
          raise ValueError("The intervention's required_stats has query groups but its query_weights "
                           "returned None.")
        parts.append(weights.astype(jnp.float32))
      elif name == "policy":
        parts.append(policy_weights().astype(jnp.float32) * real)
      else:
        parts.append(real)
    return jnp.concatenate(parts, axis=1) if parts else None

  def derive(self, output: ForwardOutput, target: StatsSpec, role: str = "user") -> ForwardOutput:
    """The `ForwardOutput` a forward run with `target` would have returned (same logits, no cache).

    role: "user", "intervention" or "policy": whose query groups a grouped target reads. Every statistic is sliced
    to the target's layers; its "Q" axis (`STATISTICS` layout) to the target's query groups (or summed to
    all queries), its "N" axis averaged when the target is head-averaged.
    """
    source = self.forward_spec
    stats = {}
    for name in target.names:
      x = output.stats[name]
      if target.layers != source.layers:
        index = target.layers if source.layers is None else tuple(source.layers.index(l) for l in target.layers)
        x = x[jnp.asarray(index)]
      axes = STATISTICS[name].axes
      if "Q" in axes and source.query_groups:
        x = self._groups(x, axes.index("Q"), target, role)
      if "N" in axes and source.per_head and not target.per_head:
        x = jnp.mean(x, axis=axes.index("N"), keepdims=True)
      stats[name] = x
    return ForwardOutput(logits=output.logits, stats=stats)

  def _groups(self, x: jax.Array, axis: int, target: StatsSpec, role: str) -> jax.Array:
    """The target's query groups of x along `axis`: its own span, or one group summing all queries."""
    take = lambda span: jax.lax.slice_in_dim(x, span.start, span.stop, axis=axis)  # noqa: E731
    if target.query_groups:
      return take(self._span({"user": "sampler"}.get(role, role)))
    if self.group_spans[0][0] == "sampler" and not self.own_groups:
      return jnp.sum(take(self._span("sampler")), axis=axis, keepdims=True)
    return take(self._span("all"))

  def user_stats(self, output: ForwardOutput, config: Any = None) -> dict[str, jax.Array] | None:
    """The user's statistics of one call by name, canonical layout (`STATISTICS`), plus their derived views
    (`Statistic.views`, e.g. "expert_load" [L', B, E] with routing; config: the `ModelConfig`); None when the
    user asked for none."""
    if not self.user.enabled:
      return None
    stats = dict(self.derive(output, self.user).stats)
    for name in self.user.names:
      for view, fn in STATISTICS[name].views:
        stats[view] = fn(stats[name], config)
    return stats

  def intervention_output(self, output: ForwardOutput) -> ForwardOutput:
    return self.derive(output, self.intervention, role="intervention")

  def policy_output(self, output: ForwardOutput) -> ForwardOutput:
    return self.derive(output, self.policy, role="policy").replace(max_probability=output.max_probability)

  def top_sinks(self, output: ForwardOutput, valid_keys: jax.Array) -> jax.Array | None:
    """Indices of the k keys with the most incoming attention over all queries: [L', B, N', k] int32.

    valid_keys: [B, S] bool; invalid keys (padding, unwritten cache slots) are never chosen.
    Ties: the lower position first.
    """
    if not self.sink_top_k:
      return None
    incoming = self.derive(output, self.sinks_spec).incoming_attention[:, :, 0]  # [L', B, N', S]
    scores = jnp.where(valid_keys[None, :, None, :], incoming, -jnp.inf)
    k = min(self.sink_top_k, incoming.shape[-1])
    return jax.lax.top_k(scores, k)[1].astype(jnp.int32)

  def squeeze_user(self, stats: dict[str, jax.Array] | None) -> dict[str, jax.Array] | None:
    """The users' shapes of (stacked) user statistics: see `dlm_jax.instrument.stats.squeeze`."""
    if stats is None:
      return None
    return {name: squeeze(name, x, self.user) if name in STATISTICS else x for name, x in stats.items()}

  def squeeze_sinks(self, top_sinks: jax.Array | None) -> jax.Array | None:
    """[..., L', B, N', k] -> [..., L', B, (N,) k]: the head axis only when the sinks are per head."""
    if top_sinks is None or self.sinks_spec.per_head:
      return top_sinks
    return top_sinks[..., 0, :]


def make_plan(config: Any, stats_spec: StatsSpec, intervention: Any, sink_top_k: int, padded: bool = False,
              policy: Any = None) -> StatsPlan:
  """Validates the specs against `config` (a `ModelConfig`) and returns the static plan (policy: the run's
  `dlm_jax.policy.ComputePolicy`, or None)."""
  plan = StatsPlan(user=stats_spec, intervention=intervention.required_stats(config), sink_top_k=sink_top_k,
                   padded=padded, policy=NO_STATS if policy is None else policy.required_stats(config))
  plan.check(config.n_layers)
  return plan
