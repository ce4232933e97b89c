"""What attention statistics a forward pass returns (`StatsSpec`, static) and the result (`ForwardOutput`).

Statistics are reduced inside attention, so a step costs O(L·N·S) memory, never O(L·N·S²).
Shapes use the axis letters of `dlm_jax.attention`; Q is the number of query groups.
"""

from __future__ import annotations

import dataclasses

import jax
from flax import struct


@dataclasses.dataclass(frozen=True)
class StatsSpec:
  """Static description of the statistics to compute (hashable: part of the compiled program's key).

  Attributes:
    incoming_attention: return, per layer and key, the incoming attention: the sum over queries of the
      softmax probability each query gives that key.
    per_head: keep the query-head axis N; when False, average over heads.
    layers: indices of the layers to return (in this order); None returns every layer.
    query_groups: 0 sums over all queries. Q > 0 requires `query_weights` of shape [B, Q, T] at call time
      and returns one incoming-attention map per group: the weighted sum over queries (use 0/1 weights to
      restrict to, e.g., the still-masked positions, the decoded ones, or the prompt).
    value_norms: return the L2 norm of every key position's value vector per kv head.
  """

  incoming_attention: bool = False
  per_head: bool = True
  layers: tuple[int, ...] | None = None
  query_groups: int = 0
  value_norms: bool = False

  def __post_init__(self):
    if self.layers is not None:
      if not isinstance(self.layers, tuple) or not all(isinstance(i, int) and i >= 0 for i in self.layers):
        raise ValueError(f"StatsSpec.layers must be None or a tuple of layer indices >= 0, got {self.layers!r}.")
      if len(set(self.layers)) != len(self.layers):
        raise ValueError(f"StatsSpec.layers has repeated layer indices: {self.layers!r}.")
    if not isinstance(self.query_groups, int) or self.query_groups < 0:
      raise ValueError(f"StatsSpec.query_groups must be an integer >= 0, got {self.query_groups!r}.")

  @property
  def enabled(self) -> bool:
    return self.incoming_attention or self.value_norms

  def check_layers(self, n_layers: int) -> None:
    """Raises if a requested layer index does not exist in a model with `n_layers` layers."""
    if self.layers is not None and any(i >= n_layers for i in self.layers):
      raise ValueError(f"StatsSpec.layers={self.layers} asks for layers beyond the model's {n_layers} layers.")


NO_STATS = StatsSpec()


@struct.dataclass
class ForwardOutput:
  """Result of `dlm_jax.model.forward`.

  Attributes:
    logits: [B, W, V] float32 raw logits (no shift) for the W positions of the logits window.
    incoming_attention: None unless requested. [L', B, N, S] per head, [L', B, S] head-averaged; with
      Q query groups [L', B, Q, N, S] or [L', B, Q, S]. L' is the number of selected layers.
    value_norms: None unless requested; [L', B, K, S] float32.
  """

  logits: jax.Array
  incoming_attention: jax.Array | None = None
  value_norms: jax.Array | None = None
