"""The call plan: the one seam every per-call decision of a model call goes through.

A run's static description (`CallPlan`: the statistics plan, the attention-bias intervention, the activation
hooks, and — DESIGN decision 13 — the place of a compute policy) and its traced state (`CallState`, carried
from call t to call t+1) give, for one model call, everything the forward needs (`PreparedCall`: the bias, the
statistics' query weights, the `HookCall`, the intervention's record), and after the call one function turns
the call's `ForwardOutput` into the next state. The samplers' model caller (`dlm_jax.sampling.model_call`) and
the plain forward under an intervention (`intervened_forward`) both use it.

    plan = CallPlan(config, stats=StatsPlan(...), intervention=..., hooks=...)
    state = plan.init_state(batch, seq_len, gen_start)            # CallState
    call = plan.prepare(state, context, sampler_weights, query_valid)
    output = forward(..., instruments=CallInstruments(bias=base_bias + call.bias, stats_spec=...,
                                                      query_weights=call.query_weights, hooks=call.hooks))
    state = plan.update(state, output, context)                   # once per model call

Hooks are a field of the run, not an intervention: their state (`HookState`: the traced hook values and, per
sequence position, whether it was unresolved at the last call that computed it — a decoded position that was
is "committed") lives beside the intervention's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dlm_jax.config import ModelConfig
from dlm_jax.core.attention_bias import AttentionBias
from dlm_jax.instrument.hook_call import COMMITTED, DECODED, MASKED, PROMPT, VALID, HookCall, HookValues, hook_values
from dlm_jax.instrument.hook_spec import NO_HOOKS, Hooks
from dlm_jax.instrument.interventions import NO_INTERVENTION, CallContext, Intervention
from dlm_jax.instrument.stats import NO_STATS, ForwardOutput, StatsSpec, merge_specs
from dlm_jax.model import forward
from dlm_jax.model.forward_inputs import CallInstruments
from dlm_jax.policy.base import NO_POLICY, ComputePolicy, Decision
from dlm_jax.sampling.stats_plan import StatsPlan


@struct.dataclass
class HookState:
  """values: the hooks' traced `HookValues`; was_unresolved: [B, S] bool, each position unresolved at the
  last call that computed its query (generated positions start unresolved)."""

  values: HookValues
  was_unresolved: jax.Array


@struct.dataclass
class PolicyState:
  """state: the compute policy's own state (batch-leading arrays); cache: the `KVCache` [L, B, S, K, H] its
  query and key subsets read (every position's keys and values as last computed), or the policy's own cache
  (`ComputePolicy.init_cache`; a reuse policy's `ReuseCache`), batch on axis 1."""

  state: Any
  cache: Any


@struct.dataclass
class CallState:
  """The traced state a run carries from one model call to the next.

  intervention: the intervention's state (`Intervention.init_state`); hooks: the `HookState`, None without
  hooks; policy: the `PolicyState`, None without a compute policy.
  """

  intervention: Any
  hooks: HookState | None = None
  policy: PolicyState | None = None


@struct.dataclass
class PreparedCall:
  """What one model call is given by the plan.

  bias: the intervention's `AttentionBias` (the caller adds the padding bias); query_weights: [B, Q, T] the
  forward's query-group weights, or None; hooks: the call's `HookCall`, or None; record: the intervention's
  record of the call (taken before it), or None.
  """

  bias: AttentionBias
  query_weights: jax.Array | None
  hooks: HookCall | None
  record: Any


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
class CallPlan:
  """Static description of every model call of a run (hashable: part of the compiled program's key).

  config: the model config; stats: the `StatsPlan` (who reads which statistics); intervention: the
  attention-bias intervention; hooks: captures and edits at named sites (`dlm_jax.instrument.hook_spec`);
  max_steps: the run's step bound, for the captures' kept steps (0: every capture keeps every call);
  record_intervention: also return the intervention's per-call record; policy: the compute policy
  (`dlm_jax.policy`, bound to the run), which decides what each call computes (applied by the model caller).
  """

  config: ModelConfig
  stats: StatsPlan = StatsPlan()
  intervention: Intervention = NO_INTERVENTION
  hooks: Hooks = NO_HOOKS
  max_steps: int = 0
  record_intervention: bool = False
  policy: ComputePolicy = NO_POLICY

  def init_state(self, batch: int, seq_len: int, gen_start: int = 0, intervention_state: Any = None,
                 values: HookValues | None = None, dtype: Any = jnp.float32) -> CallState:
    """The `CallState` for [B, S] sequences whose generation starts at `gen_start`; the intervention's state
    defaults to its `init_state`, the hook values to `hook_values`' defaults; dtype: the policy cache's."""
    if intervention_state is None:
      intervention_state = self.intervention.init_state(self.config, batch, seq_len)
    hooks = None
    if self.hooks.enabled:
      if values is None:
        values = hook_values(self.hooks, self.config, batch, seq_len)
      was = jnp.broadcast_to(jnp.arange(seq_len)[None, :] >= gen_start, (batch, seq_len))
      hooks = HookState(values=values, was_unresolved=was)
    policy = None
    if self.policy.enabled:
      policy = PolicyState(state=self.policy.init_state(self.config, batch),
                           cache=self.policy.init_cache(self.config, batch, seq_len, dtype))
    return CallState(intervention=intervention_state, hooks=hooks, policy=policy)

  def prepare(self, state: CallState, context: CallContext, sampler_weights: Callable[[], jax.Array] | None,
              query_valid: jax.Array) -> PreparedCall:
    """The call's bias, query weights, hooks and record. sampler_weights: a zero-argument callable giving the
    [B, Q, T] weights of the user's query groups (the sampler's groups, or a plain forward's own weights);
    query_valid: [B, T] bool, the real queries."""
    istate = state.intervention
    record = self.intervention.record(istate) if self.record_intervention else None
    weights = None
    if self.stats.forward_spec.query_groups:
      weights = self.stats.query_weights(sampler_weights,
                                         lambda: self.intervention.query_weights(istate, context), query_valid,
                                         lambda: self.policy.query_weights(state.policy.state, context))
    return PreparedCall(bias=self.intervention.bias(istate, context), query_weights=weights,
                        hooks=self._hook_call(state.hooks, context), record=record)

  def _hook_call(self, hooks: HookState | None, context: CallContext) -> HookCall | None:
    if hooks is None:
      return None
    return HookCall(hooks=self.hooks, values=hooks.values, flags=position_flags(context, hooks.was_unresolved),
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

  def update(self, state: CallState, output: ForwardOutput, context: CallContext,
             decision: Decision | None = None) -> CallState:
    """The state after the call (`output`: the forward's output, conditional half under CFG, with the policy's
    new cache; decision: the policy's `Decision` for the call)."""
    istate = self.intervention.update(state.intervention, self.stats.intervention_output(output), context)
    hooks = state.hooks
    if hooks is not None:
      offset = jnp.asarray(context.query_offset, jnp.int32)
      unresolved = context.unresolved
      if unresolved is None:
        unresolved = jnp.zeros((hooks.was_unresolved.shape[0], context.n_queries), bool)
      hooks = hooks.replace(was_unresolved=jax.lax.dynamic_update_slice_in_dim(hooks.was_unresolved, unresolved,
                                                                               offset, axis=1))
    policy = state.policy
    if policy is not None:
      policy_output = self.stats.policy_output(output).replace(refresh=output.refresh, cache=output.cache)
      policy = PolicyState(state=self.policy.update(policy.state, policy_output, context, decision),
                           cache=output.cache)
    return CallState(intervention=istate, hooks=hooks, policy=policy)

  def keep_rows(self, new: CallState, old: CallState, active: jax.Array) -> CallState:
    """`new` for the rows that decoded (active [B] bool), `old` for the rows that waited."""
    hooks = new.hooks
    if hooks is not None:
      hooks = hooks.replace(was_unresolved=jnp.where(active[:, None], new.hooks.was_unresolved,
                                                     old.hooks.was_unresolved))
    policy = new.policy
    if policy is not None:
      pick = lambda axis: lambda n, o: jnp.where(active.reshape((1,) * axis + (-1,) + (1,) * (n.ndim - axis - 1)),
                                                 n, o)  # noqa: E731
      policy = PolicyState(state=jax.tree.map(pick(0), new.policy.state, old.policy.state),
                           cache=jax.tree.map(pick(1), new.policy.cache, old.policy.cache))
    return CallState(intervention=self.intervention.keep_rows(new.intervention, old.intervention, active),
                     hooks=hooks, policy=policy)


def intervened_forward(params: Any, tokens: jax.Array, intervention: Intervention, state: Any, *,
                       config: ModelConfig, step: jax.Array | int = 0, stats_spec: StatsSpec = NO_STATS,
                       **forward_kwargs: Any) -> tuple[ForwardOutput, Any]:
  """`dlm_jax.model.forward` under `intervention`, through the call plan: bias → forward → update. Returns
  (output, the intervention's new state).

  tokens: [B, S]; stats_spec: the statistics wanted (the output holds these and those the intervention reads,
  one spec when they agree on heads, layers and query groups — `merge_specs` —, else these alone; the forward
  computes both side by side, `StatsPlan`); `query_weights` [B, Q, T]
  given here are the weights of stats_spec's query groups; `hooks` (a `HookCall`) are the call's hooks; other
  keyword arguments (positions, readout, compute) go to `forward`.
  """
  user_weights = forward_kwargs.pop("query_weights", None)
  hooks = forward_kwargs.pop("hooks", None)
  plan = CallPlan(config, stats=StatsPlan(user=stats_spec, intervention=intervention.required_stats(config),
                                          own_groups=True), intervention=intervention)
  plan.stats.check(config.n_layers)
  context = CallContext(step=jnp.asarray(step, jnp.int32), tokens=tokens)
  if stats_spec.query_groups and (user_weights is None or user_weights.shape[1] != stats_spec.query_groups):
    got = None if user_weights is None else tuple(user_weights.shape)
    raise ValueError(f"StatsSpec.query_groups={stats_spec.query_groups} needs query_weights of shape "
                     f"[B, {stats_spec.query_groups}, T]; got {got}.")
  call = plan.prepare(CallState(intervention=state), context, lambda: user_weights,
                      jnp.ones(tokens.shape, bool))
  instruments = CallInstruments(bias=call.bias, stats_spec=plan.stats.forward_spec, query_weights=call.query_weights,
                                hooks=hooks)
  output = forward(params, tokens, config=config, instruments=instruments, **forward_kwargs)
  new_state = plan.update(CallState(intervention=state), output, context).intervention
  return output.replace(stats=_returned_stats(plan.stats, output, stats_spec)), new_state


def _returned_stats(plan: StatsPlan, output: ForwardOutput, wanted: StatsSpec) -> dict:
  """What `intervened_forward` returns: the statistics asked for together with those the intervention reads
  (`merge_specs`), or, where the two cannot share one spec (different heads, layers or query groups), those
  asked for alone; the intervention's own when none were asked for."""
  if not wanted.enabled:
    return plan.intervention_output(output).stats
  try:
    target = merge_specs(wanted, plan.intervention)
  except ValueError:
    target = wanted
  return plan.derive(output, target).stats
