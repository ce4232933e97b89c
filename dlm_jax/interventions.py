"""Attention-bias interventions: static descriptions plus traced state, applied at every model call.

An `Intervention` is a frozen (hashable) dataclass, so it is part of a compiled program's static key; the
arrays that vary between conditions or steps live in its *state*, a pytree carried through the sampler
loop. One model call of a sampler then does:

    bias = intervention.bias(state, context)            # AttentionBias for this call
    output = forward(..., pairwise_bias=bias.pairwise, key_bias=bias.keys, stats_spec=...)
    state = intervention.update(state, output, context)  # e.g. remember this step's sinks

`required_stats` says which statistics `update` reads (the sampler asks the forward for them).
Shapes use the axis letters of `dlm_jax.attention`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from dlm_jax.attention import MASK_VALUE
from dlm_jax.config import ModelConfig
from dlm_jax.stats import NO_STATS, ForwardOutput, StatsSpec


@struct.dataclass
class AttentionBias:
  """Additive attention biases for one model call; either may be None.

  pairwise: [B|1, N|1, T|1, S] shared by all layers, or [L, B|1, N|1, T|1, S] per layer.
  keys: [B|1, N|1, S] shared by all layers, or [L, B|1, N|1, S] per layer (broadcast over queries).
  """

  pairwise: jax.Array | None = None
  keys: jax.Array | None = None

  def __add__(self, other: AttentionBias) -> AttentionBias:
    return AttentionBias(pairwise=_add(self.pairwise, other.pairwise), keys=_add(self.keys, other.keys))


def _add(a: jax.Array | None, b: jax.Array | None) -> jax.Array | None:
  """Sum of two broadcastable biases; a per-layer bias (extra leading axis) broadcasts the other."""
  if a is None or b is None:
    return b if a is None else a
  return a + b


@struct.dataclass
class CallContext:
  """What an intervention may read about the model call it biases.

  step: scalar int32, the index of the model call within the sampler run (0 for a plain forward).
  tokens: [B, S] the tokens given to the model at this call.
  """

  step: jax.Array
  tokens: jax.Array


@dataclasses.dataclass(frozen=True)
class Intervention:
  """Base class: no bias, no state, no statistics needed. Subclasses override what they use."""

  def required_stats(self, config: ModelConfig) -> StatsSpec:
    """Statistics `update` needs from every model call."""
    del config
    return NO_STATS

  def init_state(self, config: ModelConfig, batch_size: int, seq_len: int) -> Any:
    """Initial traced state for a run over [batch_size, seq_len] token canvases."""
    del config, batch_size, seq_len
    return ()

  def bias(self, state: Any, context: CallContext) -> AttentionBias:
    del state, context
    return AttentionBias()

  def update(self, state: Any, output: ForwardOutput, context: CallContext) -> Any:
    del output, context
    return state


NO_INTERVENTION = Intervention()


@dataclasses.dataclass(frozen=True)
class MaskKeys(Intervention):
  """Removes fixed key positions from every query's view (all layers, all heads).

  The positions are data: `init_state` expects them later through `with_positions`, so one compiled
  program serves every choice of positions. State: key_mask [B, S] bool, True = masked.
  """

  def init_state(self, config: ModelConfig, batch_size: int, seq_len: int) -> jax.Array:
    del config
    return jnp.zeros((batch_size, seq_len), bool)

  @staticmethod
  def with_positions(state: jax.Array, positions: jax.Array) -> jax.Array:
    """Marks key `positions` [B, P] (int; -1 = none) as masked in state [B, S]."""
    rows = jnp.arange(state.shape[0])[:, None]
    valid = positions >= 0
    return state.at[rows, jnp.where(valid, positions, 0)].max(valid)

  def bias(self, state: jax.Array, context: CallContext) -> AttentionBias:
    del context
    return AttentionBias(keys=jnp.where(state, MASK_VALUE, 0.0)[:, None, :])


@dataclasses.dataclass(frozen=True)
class Compose(Intervention):
  """Applies several interventions together: biases add, each keeps its own state."""

  parts: tuple[Intervention, ...] = ()

  def required_stats(self, config: ModelConfig) -> StatsSpec:
    specs = [p.required_stats(config) for p in self.parts]
    specs = [s for s in specs if s.enabled]
    if len(set(specs)) > 1:
      raise ValueError(f"Composed interventions need different statistics {specs}; compose at most one "
                       "intervention that reads statistics.")
    return specs[0] if specs else NO_STATS

  def init_state(self, config: ModelConfig, batch_size: int, seq_len: int) -> tuple[Any, ...]:
    return tuple(p.init_state(config, batch_size, seq_len) for p in self.parts)

  def bias(self, state: tuple[Any, ...], context: CallContext) -> AttentionBias:
    total = AttentionBias()
    for part, part_state in zip(self.parts, state):
      total = total + part.bias(part_state, context)
    return total

  def update(self, state: tuple[Any, ...], output: ForwardOutput, context: CallContext) -> tuple[Any, ...]:
    return tuple(p.update(s, output, context) for p, s in zip(self.parts, state))
