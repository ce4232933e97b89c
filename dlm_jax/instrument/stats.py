"""Attention statistics: what a forward pass computes (`StatsSpec`), its result (`ForwardOutput`), the
sampler's query groups, and the squeeze to users' shapes. The planner that merges every consumer of a
sampler step is `dlm_jax.sampling.stats_plan`.

One layout inside the library. Incoming attention is always [L', B, Q, N', S]: L' selected layers, Q
query groups (Q = 1 without groups: the sum over all queries), N' heads (N' = 1 when head-averaged), S
keys. Value norms are [L', B, K, S]. Nothing chooses behaviour by the rank of a statistics array; the
squeezed forms users see (no Q axis without query groups, no head axis when averaged) are produced once,
by `squeeze_incoming`, at the edge (`dlm_jax.sampling.Trace`, the binaries' outputs).

Statistics are reduced inside attention, so a step costs O(L'·N·S) memory, never O(L·N·S²); layers not
asked for are not reduced at all. Shapes use the axis letters of `dlm_jax.model.attention`.
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
