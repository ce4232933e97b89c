"""`Instrumented`: a sampler's intervention with activation hooks (captures and edits) beside its attention
biases.

The driver wraps the run's intervention when hooks are asked for (`dlm_jax.sampling.driver.run_family(...,
hooks=..., hook_values=...)`); every model call then gets a `HookCall` whose queries carry their position
classes (`dlm_jax.instrument.hook_spec`): the call's `CallContext` says which queries are unresolved,
which are real (not padding) and where generation starts, and the state remembers, per sequence position,
whether it was unresolved at the last call that computed it — a decoded position that was is "committed".
The wrapped intervention keeps its state, biases, statistics and records unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dlm_jax.config import ModelConfig
from dlm_jax.instrument.hook_call import (COMMITTED, DECODED, MASKED, PROMPT, VALID, HookCall, HookValues,
                                          hook_values)
from dlm_jax.instrument.hook_spec import Hooks
from dlm_jax.instrument.interventions import CallContext, Intervention
from dlm_jax.instrument.stats import ForwardOutput, StatsSpec
from dlm_jax.core.attention_bias import AttentionBias


@struct.dataclass
class InstrumentState:
  """values: the hooks' traced `HookValues`; was_unresolved: [B, S] bool, each position unresolved at the
  last call that computed its query (generated positions start unresolved)."""

  values: HookValues
  was_unresolved: jax.Array


def position_flags(context: CallContext, was_unresolved: jax.Array) -> jax.Array:
  """[B, T] int32 class bits of the call's queries (`dlm_jax.instrument.hook_call`)."""
  b, t = context.tokens.shape[0], context.n_queries
  generated = (context.query_index >= context.gen_start)[None, :]
  unresolved = jnp.zeros((b, t), bool) if context.unresolved is None else context.unresolved
  valid = jnp.ones((b, t), bool) if context.query_valid is None else context.query_valid
  before = jax.lax.dynamic_slice_in_dim(was_unresolved, jnp.asarray(context.query_offset, jnp.int32), t, axis=1)
  decoded = valid & generated & ~unresolved
  bits = [(VALID, valid), (PROMPT, valid & ~generated & ~unresolved), (MASKED, valid & unresolved),
          (DECODED, decoded), (COMMITTED, decoded & before)]
  return sum(jnp.where(mask, bit, 0) for bit, mask in bits).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class Instrumented(Intervention):
  """`inner`'s attention biases and state, plus `hooks` at every model call (module docstring). State:
  (inner state, `InstrumentState`). max_steps: the run's step bound, for `HookCall.keep` (0: every capture
  keeps every step)."""

  inner: Intervention
  hooks: Hooks
  max_steps: int = 0

  def required_stats(self, config: ModelConfig) -> StatsSpec:
    return self.inner.required_stats(config)

  def init_state(self, config: ModelConfig, batch_size: int, seq_len: int, values: HookValues | None = None,
                 inner_state: Any = None, gen_start: int = 0) -> tuple[Any, InstrumentState]:
    """(inner state, `InstrumentState`) for [B, S] sequences whose generation starts at `gen_start`; values
    default to `hook_values`' defaults."""
    if inner_state is None:
      inner_state = self.inner.init_state(config, batch_size, seq_len)
    if values is None:
      values = hook_values(self.hooks, config, batch_size, seq_len)
    was = jnp.broadcast_to(jnp.arange(seq_len)[None, :] >= gen_start, (batch_size, seq_len))
    return inner_state, InstrumentState(values=values, was_unresolved=was)

  def bias(self, state, context: CallContext) -> AttentionBias:
    return self.inner.bias(state[0], context)

  def query_weights(self, state, context: CallContext) -> jax.Array | None:
    return self.inner.query_weights(state[0], context)

  def hook_call(self, state, context: CallContext) -> HookCall:
    instrument = state[1]
    return HookCall(hooks=self.hooks, values=instrument.values, flags=position_flags(context, instrument.was_unresolved),
                    step=context.step, keep=self._keep(context.step))

  def _keep(self, step: jax.Array) -> jax.Array | None:
    """[n captures] bool: each capture keeps step `step` (`Steps.slots`; block starts and decoded positions
    are known only after the call, so those keep every step)."""
    if not self.max_steps or not self.hooks.captures:
      return None
    table = np.ones((len(self.hooks.captures), self.max_steps), bool)
    for i, capture in enumerate(self.hooks.captures):
      if capture.steps.kind in ("all", "at", "every"):
        table[i] = np.asarray(capture.steps.slots(self.max_steps)) >= 0
    return jnp.asarray(table)[:, jnp.clip(step, 0, self.max_steps - 1)]

  def update(self, state, output: ForwardOutput, context: CallContext):
    inner, instrument = state
    was = instrument.was_unresolved
    if context.unresolved is not None:
      was = jax.lax.dynamic_update_slice_in_dim(was, context.unresolved, jnp.asarray(context.query_offset, jnp.int32),
                                                axis=1)
    else:
      was = jax.lax.dynamic_update_slice_in_dim(was, jnp.zeros((was.shape[0], context.n_queries), bool),
                                                jnp.asarray(context.query_offset, jnp.int32), axis=1)
    return self.inner.update(inner, output, context), instrument.replace(was_unresolved=was)

  def keep_rows(self, new, old, active: jax.Array):
    was = jnp.where(active[:, None], new[1].was_unresolved, old[1].was_unresolved)
    return self.inner.keep_rows(new[0], old[0], active), new[1].replace(was_unresolved=was)

  def record(self, state) -> Any:
    return self.inner.record(state[0])
