"""Attention statistics: what a forward pass computes (`StatsSpec`), its result (`ForwardOutput`), the one
planner that merges every consumer of a sampler step (`StatsPlan`), and the squeeze to users' shapes.

One layout inside the library. Incoming attention is always [L', B, Q, N', S]: L' selected layers, Q
query groups (Q = 1 without groups: the sum over all queries), N' heads (N' = 1 when head-averaged), S
keys. Value norms are [L', B, K, S]. Nothing chooses behaviour by the rank of a statistics array; the
squeezed forms users see (no Q axis without query groups, no head axis when averaged) are produced once,
by `squeeze_incoming`, at the edge (`dlm_jax.sampling.Trace`, the binaries' outputs).

Statistics are reduced inside attention, so a step costs O(L'·N·S) memory, never O(L·N·S²); layers not
asked for are not reduced at all. Shapes use the axis letters of `dlm_jax.attention`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct


@dataclasses.dataclass(frozen=True)
class StatsSpec:
  """Static description of the statistics to compute (hashable: part of the compiled program's key).

  Attributes:
    incoming_attention: return, per layer and key, the incoming attention: the sum over queries of the
      softmax probability each query gives that key.
    per_head: keep the query-head axis (N' = N); when False, average over heads (N' = 1).
    layers: indices of the layers to return (in this order); None returns every layer. The other layers
      compute no statistics.
    query_groups: 0 sums over all queries (Q = 1). Q > 0 requires `query_weights` of shape [B, Q, T] at
      call time and returns one incoming-attention map per group: the weighted sum over queries (use 0/1
      weights to restrict to, e.g., the still-masked positions, the decoded ones, or the prompt).
    value_norms: return the L2 norm of every key position's value vector per kv head.
    routing: return, for a mixture-of-experts model, the router's choice at every position of every
      (selected) layer: the k chosen experts and their weights, [L', B, S, k] (dense layers and positions
      the call did not compute: expert −1, weight 0). The weights are the router's, before any capacity
      drop. Samplers also report the expert load ([L', B, E] tokens per expert; `expert_load`).
  """

  incoming_attention: bool = False
  per_head: bool = True
  layers: tuple[int, ...] | None = None
  query_groups: int = 0
  value_norms: bool = False
  routing: bool = False

  def __post_init__(self):
    if self.layers is not None:
      if not isinstance(self.layers, tuple) or not all(isinstance(i, int) and i >= 0 for i in self.layers):
        raise ValueError(f"StatsSpec.layers must be None or a tuple of layer indices >= 0, got {self.layers!r}.")
      if len(set(self.layers)) != len(self.layers):
        raise ValueError(f"StatsSpec.layers has repeated layer indices: {self.layers!r}.")
      if not self.layers:
        raise ValueError("StatsSpec.layers is empty; use None for every layer or name at least one layer.")
    if not isinstance(self.query_groups, int) or self.query_groups < 0:
      raise ValueError(f"StatsSpec.query_groups must be an integer >= 0, got {self.query_groups!r}.")

  @property
  def enabled(self) -> bool:
    return self.incoming_attention or self.value_norms or self.routing

  def check_layers(self, n_layers: int) -> None:
    """Raises if a requested layer index does not exist in a model with `n_layers` layers."""
    if self.layers is not None and any(i >= n_layers for i in self.layers):
      raise ValueError(f"StatsSpec.layers={self.layers} asks for layers beyond the model's {n_layers} layers.")


NO_STATS = StatsSpec()


@struct.dataclass
class ForwardOutput:
  """Result of `dlm_jax.model.forward`.

  Attributes:
    logits: [B, W, V] float32 raw logits (no shift) for the W positions of the logits window (None when
      the hidden states were asked for instead).
    incoming_attention: None unless requested; [L', B, Q, N', S] float32 (module docstring).
    value_norms: None unless requested; [L', B, K, S] float32.
    routed_experts: None unless routing was requested; [L', B, S, k] int32, the experts each position was
      sent to (−1 in dense layers and at positions the call did not compute).
    routing_weights: None unless routing was requested; [L', B, S, k] float32, their weights (0 there).
    cache: the updated `dlm_jax.model.KVCache` of a cached call, else None.
    hidden: with `return_hidden`, the final-normed hidden states [B, W, D] of the window, else None.
  """

  logits: jax.Array | None
  incoming_attention: jax.Array | None = None
  value_norms: jax.Array | None = None
  routed_experts: jax.Array | None = None
  routing_weights: jax.Array | None = None
  cache: Any = None
  hidden: jax.Array | None = None


def squeeze_incoming(incoming: jax.Array, spec: StatsSpec) -> jax.Array:
  """Users' shape of incoming attention [..., L', B, Q, N', S] computed under `spec`:
  [..., L', B, (Q,) (N,) S] — the Q axis only with query groups, the head axis only per head."""
  if not spec.per_head:
    incoming = incoming[..., 0, :]
  if not spec.query_groups:
    incoming = incoming[..., 0, :, :] if spec.per_head else incoming[..., 0, :]
  return incoming


def expert_load(routed_experts: jax.Array, n_experts: int) -> jax.Array:
  """Tokens sent to each expert: routed experts [..., S, k] int32 (−1 = none) -> [..., E] float32 counts
  (a token counts once for each of its k experts)."""
  one_hot = jax.nn.one_hot(routed_experts, n_experts, dtype=jnp.float32)  # −1 gives an all-zero row
  return jnp.sum(one_hot, axis=(-3, -2))


QUERY_GROUP_NAMES = ("masked", "unmasked", "prompt")
"""The sampler's query groups (a user spec with query_groups=3), built at each model call from the positions
that play the mask role (`unresolved`; by default the positions holding the mask token):
  0 masked:   unresolved query positions;
  1 unmasked: generation-region query positions that are resolved;
  2 prompt:   prompt query positions that are resolved.
Without a mask token (DiffusionGemma's uniform-state canvases) a decoder step's unresolved positions are
those of its canvas not holding the token the previous step accepted (the whole random canvas at a
canvas's first step), so group 1 is the accepted positions and group 2 is empty; its encoder calls have
no unresolved position (the prompt's queries are group 2, a re-encoded finished canvas's group 1).
In a left-padded batch pad queries belong to no group (see `StatsPlan.padded`)."""


def query_group_weights(unresolved: jax.Array, gen_start: int, query_offset: jax.Array | int = 0) -> jax.Array:
  """[B, 3, T] float32 0/1 weights of the masked / unmasked-generated / prompt query groups
  (`QUERY_GROUP_NAMES`).

  unresolved: [B, T] bool, the call's queries playing the mask role; their sequence positions are
  query_offset + 0..T-1, those >= gen_start being generated."""
  generated = (query_offset + jnp.arange(unresolved.shape[1]))[None, :] >= gen_start
  groups = [unresolved, generated & ~unresolved, ~generated & ~unresolved]
  return jnp.stack(groups, axis=1).astype(jnp.float32)


def merge_specs(a: StatsSpec, b: StatsSpec) -> StatsSpec:
  """One StatsSpec giving what both ask for: value norms if either does; incoming attention if either
  does, in which case the two must agree on per_head, layers and query_groups (else ValueError)."""
  if not (a.incoming_attention and b.incoming_attention):
    incoming = a if a.incoming_attention else b
  elif (a.per_head, a.layers, a.query_groups) == (b.per_head, b.layers, b.query_groups):
    incoming = a
  else:
    raise ValueError(f"Incompatible incoming-attention statistics {a} and {b}: ask for the same per_head, "
                     "layers and query_groups (e.g. record the ones the intervention needs).")
  return dataclasses.replace(incoming, value_norms=a.value_norms or b.value_norms, routing=a.routing or b.routing)


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
  query-group blocks of every consumer side by side) and derives each consumer's view from it.

  Attributes:
    user: the caller's spec (query_groups 0 or 3, `QUERY_GROUP_NAMES`).
    intervention: the intervention's `required_stats`.
    sink_top_k: k of the per-step top-k sinks (0 = off).
    padded: the batch is left-padded: the statistics of the user, the top sinks and an ungrouped
      intervention sum over the real queries only (pad queries are not part of any sequence; with them a
      row's statistics would depend on how much it is padded). An intervention's own query groups are
      used as it gives them.

  The forward's query groups come in blocks: "sampler" (the 3 groups, when the user asks for them),
  "all" (one group of every real query, when someone needs the sum over all queries and no sampler
  block gives it) and "intervention" (the intervention's groups). Without any grouped consumer and
  without padding the forward is ungrouped.
  """

  user: StatsSpec = NO_STATS
  intervention: StatsSpec = NO_STATS
  sink_top_k: int = 0
  padded: bool = False

  def __post_init__(self):
    if self.user.query_groups not in (0, len(QUERY_GROUP_NAMES)):
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
  def group_blocks(self) -> tuple[tuple[str, int], ...]:
    """((name, size), ...) of the forward's query-group blocks; () = ungrouped."""
    consumers = [s for s in (self.user, self.intervention, self.sinks_spec) if s.incoming_attention]
    blocks = []
    if self.user.incoming_attention and self.user.query_groups:
      blocks.append(("sampler", len(QUERY_GROUP_NAMES)))
    if self.intervention.incoming_attention and self.intervention.query_groups:
      blocks.append(("intervention", self.intervention.query_groups))
    if ((blocks or self.padded) and (not blocks or blocks[0][0] != "sampler")
        and any(not s.query_groups for s in consumers)):
      blocks.insert(0, ("all", 1))
    return tuple(blocks)

  def _block(self, name: str) -> slice:
    start = 0
    for block, size in self.group_blocks:
      if block == name:
        return slice(start, start + size)
      start += size
    raise KeyError(name)

  @property
  def forward_spec(self) -> StatsSpec:
    """The one spec the forward pass is run with."""
    incoming = [s for s in (self.user, self.intervention, self.sinks_spec) if s.incoming_attention]
    values = [s for s in (self.user, self.intervention) if s.value_norms]
    routing = [s for s in (self.user, self.intervention) if s.routing]
    if not incoming and not values and not routing:
      return NO_STATS
    return StatsSpec(
        incoming_attention=bool(incoming),
        per_head=any(s.per_head for s in incoming) if incoming else True,
        layers=_union_layers(incoming + values + routing),
        query_groups=sum(size for _, size in self.group_blocks),
        value_norms=bool(values), routing=bool(routing))

  def check(self, n_layers: int) -> None:
    self.forward_spec.check_layers(n_layers)

  def query_weights(self, sampler_weights, intervention_weights, query_valid: jax.Array) -> jax.Array | None:
    """[B, Q, T] weights of the forward's groups, from zero-argument callables giving the sampler's and the
    intervention's blocks; query_valid: [B, T] bool, the real queries (all True without padding)."""
    parts = []
    real = query_valid.astype(jnp.float32)[:, None, :]
    for name, _ in self.group_blocks:
      if name == "sampler":
        parts.append(sampler_weights() * real)
      elif name == "intervention":
        weights = intervention_weights()
        if weights is None:
          raise ValueError("The intervention's required_stats has query groups but its query_weights "
                           "returned None.")
        parts.append(weights.astype(jnp.float32))
      else:
        parts.append(real)
    return jnp.concatenate(parts, axis=1) if parts else None

  def derive(self, output: ForwardOutput, target: StatsSpec, role: str = "user") -> ForwardOutput:
    """The `ForwardOutput` a forward run with `target` would have returned (same logits, no cache).

    role: "user" or "intervention": whose query groups a grouped target reads.
    """
    source = self.forward_spec
    incoming, values = None, None

    def select_layers(x):
      if target.layers == source.layers:
        return x
      index = target.layers if source.layers is None else tuple(source.layers.index(l) for l in target.layers)
      return x[jnp.asarray(index)]

    if target.incoming_attention:
      incoming = select_layers(output.incoming_attention)  # [L', B, Q, N', S]
      if source.query_groups:
        if target.query_groups:
          incoming = incoming[:, :, self._block("sampler" if role == "user" else "intervention")]
        elif self.group_blocks[0][0] == "sampler":
          incoming = jnp.sum(incoming[:, :, self._block("sampler")], axis=2, keepdims=True)
        else:
          incoming = incoming[:, :, self._block("all")]
      if source.per_head and not target.per_head:
        incoming = jnp.mean(incoming, axis=3, keepdims=True)
    if target.value_norms:
      values = select_layers(output.value_norms)
    experts, weights = None, None
    if target.routing:
      experts, weights = select_layers(output.routed_experts), select_layers(output.routing_weights)
    return ForwardOutput(logits=output.logits, incoming_attention=incoming, value_norms=values,
                         routed_experts=experts, routing_weights=weights)

  def user_stats(self, output: ForwardOutput, n_experts: int = 0) -> dict[str, jax.Array] | None:
    """The user's statistics of one call, canonical layout: {"incoming_attention", "value_norms",
    "routed_experts", "routing_weights", "expert_load" ([L', B, E], from `n_experts`)} (those asked for) or
    None."""
    if not self.user.enabled:
      return None
    derived = self.derive(output, self.user)
    stats = {}
    if self.user.incoming_attention:
      stats["incoming_attention"] = derived.incoming_attention
    if self.user.value_norms:
      stats["value_norms"] = derived.value_norms
    if self.user.routing:
      stats["routed_experts"] = derived.routed_experts
      stats["routing_weights"] = derived.routing_weights
      stats["expert_load"] = expert_load(derived.routed_experts, n_experts)
    return stats

  def intervention_output(self, output: ForwardOutput) -> ForwardOutput:
    return self.derive(output, self.intervention, role="intervention")

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
    """The users' shapes of (stacked) user statistics: see `squeeze_incoming`."""
    if stats is None:
      return None
    squeezed = dict(stats)
    if "incoming_attention" in squeezed:
      squeezed["incoming_attention"] = squeeze_incoming(squeezed["incoming_attention"], self.user)
    return squeezed

  def squeeze_sinks(self, top_sinks: jax.Array | None) -> jax.Array | None:
    """[..., L', B, N', k] -> [..., L', B, (N,) k]: the head axis only when the sinks are per head."""
    if top_sinks is None or self.sinks_spec.per_head:
      return top_sinks
    return top_sinks[..., 0, :]


def make_plan(config: Any, stats_spec: StatsSpec, intervention: Any, sink_top_k: int, padded: bool = False
              ) -> StatsPlan:
  """Validates the specs against `config` (a `ModelConfig`) and returns the static plan."""
  plan = StatsPlan(user=stats_spec, intervention=intervention.required_stats(config), sink_top_k=sink_top_k,
                   padded=padded)
  plan.check(config.n_layers)
  return plan
