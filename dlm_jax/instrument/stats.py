"""Attention statistics: what a forward pass computes (`StatsSpec`), its result (`ForwardOutput`), the
sampler's query groups, and the squeeze to users' shapes. The planner that merges every consumer of a
sampler step is `dlm_jax.sampling.stats_plan`.

One layout inside the library. Incoming attention is always [L', B, Q, N', S]: L' selected layers, Q
query groups (Q = 1 without groups: the sum over all queries), N' heads (N' = 1 when head-averaged), S
keys. Value norms are [L', B, K, S]. Nothing chooses behaviour by the rank of a statistics array; the
squeezed forms users see (no Q axis without query groups, no head axis when averaged) are produced once,
by `squeeze`, at the edge (`dlm_jax.sampling.Trace`, the binaries' outputs).

Statistics are reduced inside attention, so a step costs O(L'·N·S) memory, never O(L·N·S²); layers not
asked for are not reduced at all. Shapes use the axis letters of `dlm_jax.model.attention`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
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
    extra: names of further `STATISTICS` entries to compute (those registered without a switch field of
      their own, `register_statistic`).
  """

  incoming_attention: bool = False
  per_head: bool = True
  layers: tuple[int, ...] | None = None
  query_groups: int = 0
  value_norms: bool = False
  routing: bool = False
  extra: tuple[str, ...] = ()

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
    if not isinstance(self.extra, tuple) or any(STATISTICS.get(n, _SWITCHED).switch is not None for n in self.extra):
      raise ValueError(f"StatsSpec.extra must be a tuple of registered statistics without a switch field "
                       f"({', '.join(n for n, s in STATISTICS.items() if s.switch is None) or 'none registered'}), "
                       f"got {self.extra!r}.")

  @property
  def enabled(self) -> bool:
    return bool(self.names)

  @property
  def names(self) -> tuple[str, ...]:
    """The statistics (`STATISTICS` names) this spec asks for."""
    return tuple(name for name, statistic in STATISTICS.items()
                 if (name in self.extra if statistic.switch is None else getattr(self, statistic.switch)))

  @property
  def attention(self) -> bool:
    """Some statistic asked for is reduced inside attention (needs the attention probabilities)."""
    return any(STATISTICS[name].attention for name in self.names)

  @property
  def rows(self) -> bool:
    """Some statistic asked for reads the head-mean attention rows of the call's queries (`LayerValues.rows`)."""
    return any(STATISTICS[name].rows for name in self.names)

  def asking(self, names) -> StatsSpec:
    """This spec's options (heads, layers, query groups) asking for exactly the statistics `names`."""
    switches = {s.switch for n, s in STATISTICS.items() if s.switch is not None and n in names}
    return dataclasses.replace(self, **{field: field in switches for field in SWITCHES},
                               extra=tuple(n for n in STATISTICS if n in names and STATISTICS[n].switch is None))

  def check_model(self, config) -> None:
    """Raises ValueError naming the first statistic asked for that the model (a `ModelConfig`) cannot give."""
    for name in self.names:
      reason = STATISTICS[name].unavailable(config)
      if reason:
        raise ValueError(reason)

  def check_layers(self, n_layers: int) -> None:
    """Raises if a requested layer index does not exist in a model with `n_layers` layers."""
    if self.layers is not None and any(i >= n_layers for i in self.layers):
      raise ValueError(f"StatsSpec.layers={self.layers} asks for layers beyond the model's {n_layers} layers.")


NO_STATS = StatsSpec()


@struct.dataclass
class LayerValues:
  """What one layer of a forward hands the statistics (`Statistic.compute`).

  incoming: [B, Q, N, S] the layer's incoming attention per query group and head (None unless a statistic
  asked for asks for `attention`); keys, values: [B, S, K, H] the layer's keys and values over the S key
  positions (after RoPE, the cache written); hidden: [B, T, D] the layer's output (residual stream); queries:
  [B, T, N, H] the call's queries after RoPE; query_weights: [B, Q, T] the forward's query-group weights or
  None (one group of every query); routing: the MoE router's (weights [B, T, k], experts [B, T, k])
  or None in a dense layer; n_queries: T; query_offset: sequence index of the call's first query (traced);
  per_head: the spec's head choice; k: experts per token; rows: [B, T, S] the head-mean softmax probabilities of
  every query over the S keys after every bias and mask (None unless a statistic asked for asks for `rows`).
  """

  incoming: jax.Array | None
  keys: jax.Array
  values: jax.Array
  hidden: jax.Array
  queries: jax.Array
  query_weights: jax.Array | None
  routing: Any
  query_offset: Any
  n_queries: int = struct.field(pytree_node=False)
  per_head: bool = struct.field(pytree_node=False)
  k: int = struct.field(pytree_node=False)
  rows: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class Statistic:
  """One per-call statistic: everything about it, in one entry of `STATISTICS`.

  switch: the `StatsSpec` field that asks for it, or None (asked for by name in `StatsSpec.extra`); switches
    merge by "or" (`merge_specs`, `dlm_jax.sampling.stats_plan.StatsPlan`).
  axes: the axis letters of its [L', B, ...] array (module docstring): "Q" is the query-group axis and "N"
    the head axis (N' = 1 when head-averaged), which the planner and `squeeze` treat generically.
  compute: `LayerValues` -> this layer's value [B, ...] (the axes after "L").
  attention: computed from the attention probabilities (the forward reduces them inside attention).
  unavailable: config -> the one-line reason the model cannot give it, or None.
  views: (name, fn(value [L', B, ...], config) -> array) derived for the user (e.g. the expert load).
  dtype, fill: the dtype and fill value of the buffer a layer subset is written into (a layer that computes
    nothing leaves the fill).
  rows: computed from the head-mean attention rows (the forward reduces them inside attention; axis "T" is
    the call's queries, which a compute policy's subset call puts back in sequence coordinates).
  """

  switch: str | None
  axes: tuple[str, ...]
  compute: Callable[[LayerValues], jax.Array]
  attention: bool = False
  unavailable: Callable[[Any], str | None] = lambda config: None
  views: tuple[tuple[str, Callable[[jax.Array, Any], jax.Array]], ...] = ()
  dtype: Any = jnp.float32
  fill: float = 0.0
  rows: bool = False


def _incoming(layer: LayerValues) -> jax.Array:
  return layer.incoming if layer.per_head else jnp.mean(layer.incoming, axis=2, keepdims=True)


def _value_norms(layer: LayerValues) -> jax.Array:
  return jnp.linalg.norm(layer.values.astype(jnp.float32), axis=-1).transpose(0, 2, 1)


def _routing(layer: LayerValues, part: int, fill, dtype) -> jax.Array:
  """[B, S, k] one part of the router's choice (0: weights, 1: experts) over the S sequence positions: the
  call's T queries sit at query_offset..query_offset+T−1; other positions, and every position of a dense
  layer, hold `fill`."""
  b, n_keys = layer.keys.shape[:2]
  out = jnp.full((b, n_keys, layer.k), fill, dtype)
  if layer.routing is None:
    return out
  zero = jnp.zeros((), jnp.int32)
  start = (zero, jnp.asarray(layer.query_offset, jnp.int32), zero)
  return jax.lax.dynamic_update_slice(out, layer.routing[part].astype(dtype), start)


def _query_key_scores(layer: LayerValues) -> jax.Array:
  """[B, Q, S]: per query group, the head mean of (Σ_t w_t q_t) · k_s — the weighted query sum against every
  key, raw (no scale, no softmax; GQA: query head n reads key head n // (N / K))."""
  q = layer.queries.astype(jnp.float32)
  b, t, n, h = q.shape
  weights = jnp.ones((b, 1, t), jnp.float32) if layer.query_weights is None else layer.query_weights
  summed = jnp.einsum("bqt,btnh->bqnh", weights.astype(jnp.float32), q)
  kv = layer.keys.shape[2]
  grouped = summed.reshape(b, summed.shape[1], kv, n // kv, h)
  per_head = jnp.einsum("bqkgh,bskh->bqkgs", grouped, layer.keys.astype(jnp.float32))
  return jnp.mean(per_head.reshape(b, summed.shape[1], n, -1), axis=2)


def _no_value_norms(config) -> str | None:
  if config.layer_pattern is not None:
    return ("StatsSpec.value_norms is not available for a layer_pattern model (its sliding and global layers "
            "have different kv heads); ask for incoming_attention only.")
  return None


def _no_routing(config) -> str | None:
  if not config.is_moe:
    return (f"StatsSpec.routing asks for routing statistics, but {config.name} is a dense model (n_experts = 0); "
            "leave routing False.")
  return None


_SWITCHED = Statistic("switched", (), lambda layer: None)

STATISTICS: dict[str, Statistic] = {
    # the sum over queries (per query group) of the softmax probability each query gives each key
    "incoming_attention": Statistic("incoming_attention", ("L", "B", "Q", "N", "S"), _incoming, attention=True),
    # the L2 norm of every key position's value vector per kv head
    "value_norms": Statistic("value_norms", ("L", "B", "K", "S"), _value_norms, unavailable=_no_value_norms),
    # the k experts each position was sent to (−1 in dense layers and at positions the call did not compute)
    "routed_experts": Statistic("routing", ("L", "B", "S", "k"), lambda l: _routing(l, 1, -1, jnp.int32),
                                unavailable=_no_routing,
                                views=(("expert_load", lambda x, config: expert_load(x, config.n_experts)),),
                                dtype=jnp.int32, fill=-1),
    # the router's weights of those experts (0 there)
    "routing_weights": Statistic("routing", ("L", "B", "S", "k"), lambda l: _routing(l, 0, 0.0, jnp.float32),
                                 unavailable=_no_routing),
    # per query group, the head mean of the weighted sum of the queries against every key (raw q·k; the
    # score Sparse-dLLM keeps keys by, `dlm_jax.policy.sparse_dllm`); asked for by name (StatsSpec.extra)
    "query_key_scores": Statistic(None, ("L", "B", "Q", "S"), _query_key_scores),
    # every query's softmax probabilities over the S keys after every bias and mask, averaged over the query
    # heads: [L', B, T, S], T×S per layer (d2Cache's attention rollout reads them, `dlm_jax.policy.d2cache`;
    # reduced inside attention, never [N, T, S]); asked for by name (StatsSpec.extra)
    "attention_rows": Statistic(None, ("L", "B", "T", "S"), lambda layer: layer.rows, rows=True),
}
"""Every per-call statistic by name: the only registry. The forward computes an entry at every layer asked for
(`compute`), the planner merges requests and derives each consumer's view by its layout, the CFG split,
batch-invariant calls and the `Trace` treat entries by name and layout. Adding one is one entry
(`register_statistic`)."""

SWITCHES = ("incoming_attention", "value_norms", "routing")
"""The `StatsSpec` fields that switch statistics on."""


def register_statistic(name: str, statistic: Statistic) -> None:
  """Adds a statistic asked for by name (`StatsSpec(extra=(name,))`); its `switch` must be None. Raises on a
  name already registered."""
  if name in STATISTICS or statistic.switch is not None:
    raise ValueError(f"register_statistic: {name!r} is already registered or has a switch; give a new name and "
                     "switch=None.")
  STATISTICS[name] = statistic


@struct.dataclass
class ForwardOutput:
  """Result of `dlm_jax.model.forward`.

  Attributes:
    logits: [B, W, V] float32 raw logits (no shift) for the W positions of the logits window (None when
      the hidden states were asked for instead).
    stats: the statistics asked for, by name (`STATISTICS`: e.g. "incoming_attention" [L', B, Q, N', S]
      float32, "value_norms" [L', B, K, S], "routed_experts" / "routing_weights" [L', B, S, k]); also
      readable as attributes (`output.incoming_attention`, None when not asked for).
    cache: the updated `dlm_jax.model.KVCache` of a cached call, else None.
    hidden: with `return_hidden`, the final-normed hidden states [B, W, D] of the window, else None.
    captures: the activations `hooks` captured, by name ("blocks.3.hook_resid_pre", ...; a capture's label
      instead when it has one): [B, S | P, ...] in sequence coordinates (`dlm_jax.instrument.hook_spec`).
    refresh: a layer-refresh call's `dlm_jax.model.layer_refresh.RefreshResult` (the layer inputs to cache,
      the first refreshed layer per row), else None.
    max_probability: [B, S] float32, the largest softmax probability of the call's logits at every position
      it computed (0 elsewhere), only for a compute policy that reads it (`ComputePolicy.reads_max_probability`,
      `dlm_jax.sampling.policy_call`), else None.
  """

  logits: jax.Array | None
  stats: dict[str, jax.Array] = struct.field(default_factory=dict)
  cache: Any = None
  hidden: jax.Array | None = None
  captures: dict[str, Any] = struct.field(default_factory=dict)
  refresh: Any = None
  max_probability: jax.Array | None = None

  def __getattr__(self, name: str):
    if name in STATISTICS:
      return self.__dict__.get("stats", {}).get(name)
    raise AttributeError(f"ForwardOutput has no attribute {name!r}")


def squeeze(name: str, x: jax.Array, spec: StatsSpec) -> jax.Array:
  """Users' shape of statistic `name` [..., L', B, ...] computed under `spec`: its "Q" axis only with query
  groups and its "N" axis only per head (incoming attention: [..., L', B, (Q,) (N,) S])."""
  axes = STATISTICS[name].axes
  drop = [i - len(axes) for i, a in enumerate(axes) if (a == "Q" and not spec.query_groups)
          or (a == "N" and not spec.per_head)]
  return jnp.squeeze(x, axis=tuple(drop)) if drop else x


def squeeze_incoming(incoming: jax.Array, spec: StatsSpec) -> jax.Array:
  """`squeeze` of incoming attention: [..., L', B, Q, N', S] -> [..., L', B, (Q,) (N,) S]."""
  return squeeze("incoming_attention", incoming, spec)


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
In a left-padded batch pad queries belong to no group (see `dlm_jax.sampling.stats_plan.StatsPlan.padded`)."""


def query_group_weights(unresolved: jax.Array, gen_start: int, query_offset: jax.Array | int = 0) -> jax.Array:
  """[B, 3, T] float32 0/1 weights of the masked / unmasked-generated / prompt query groups
  (`QUERY_GROUP_NAMES`).

  unresolved: [B, T] bool, the call's queries playing the mask role; their sequence positions are
  query_offset + 0..T-1, those >= gen_start being generated."""
  generated = (query_offset + jnp.arange(unresolved.shape[1]))[None, :] >= gen_start
  groups = [unresolved, generated & ~unresolved, ~generated & ~unresolved]
  return jnp.stack(groups, axis=1).astype(jnp.float32)


def merge_specs(a: StatsSpec, b: StatsSpec) -> StatsSpec:
  """One StatsSpec giving every statistic either asks for; with incoming attention on both sides the two must
  agree on per_head, layers and query_groups (else ValueError)."""
  if not (a.incoming_attention and b.incoming_attention):
    incoming = a if a.incoming_attention else b
  elif (a.per_head, a.layers, a.query_groups) == (b.per_head, b.layers, b.query_groups):
    incoming = a
  else:
    raise ValueError(f"Incompatible incoming-attention statistics {a} and {b}: ask for the same per_head, "
                     "layers and query_groups (e.g. record the ones the intervention needs).")
  return incoming.asking(set(a.names) | set(b.names))
