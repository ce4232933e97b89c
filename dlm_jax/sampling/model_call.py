"""One model evaluation of a sampler step: the call plan's decisions (`dlm_jax.sampling.call_plan`) → forward →
statistics per plan → the next call state.

A family describes a call with a few small structs (`dlm_jax.sampling.call_inputs`): its inputs (`CallInputs`),
what it reads out (`Readout`), its KV-cache use (`CacheCall`, the mode explicit) and classifier-free guidance
(`Guidance`).

CFG. With classifier-free guidance the conditional and unconditional sequences run as one 2B batch (one
model evaluation: `nfe` counts forward calls). Statistics, top sinks and the call state's update see the
conditional half only; the intervention's bias and the hooks' edits apply to both halves. This is the one place
that doubles a batch for guidance.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from dlm_jax.instrument.interventions import CallContext
from dlm_jax.instrument.stats import ForwardOutput, query_group_weights
from dlm_jax.model import KVCache, forward, lm_head
from dlm_jax.model.forward_inputs import CallInstruments, Compute
from dlm_jax.sampling import row_by_row
from dlm_jax.sampling.call_inputs import CacheCall, CallInputs, Guidance, Readout
from dlm_jax.sampling.call_plan import CallPlan, CallState
from dlm_jax.sampling.policy_call import (Confidence, computed_positions, family_cache_forward, keys_read,
                                         policy_forward)


@struct.dataclass
class StepOutput:
  """What the driver stacks over steps (each None when not asked for).

  stats: the user's statistics of the step, library layout ({"incoming_attention": [L', B, Q, N', S],
    "value_norms": [L', B, K, S], "routed_experts" / "routing_weights": [L', B, S, k], "expert_load":
    [L', B, E]}; `dlm_jax.sampling.stats_plan.StatsPlan.user_stats`).
  top_sinks: [L', B, N', k] int32.
  record: the intervention's record of the step (`Intervention.record`, taken before the call).
  active: [B] bool, the rows the step decoded for (set by the family; the driver fills all-true when None).
  queries: [2] int32, the sequence positions [start, stop) whose queries the step computed (set by families
    that compute part of the sequence; under a compute policy the span of `computed` over the rows; the driver
    fills [0, S) when None).
  accepted: [B, C] bool, the canvas positions a uniform-state step accepted (DiffusionGemma; None for the
    other families).
  canvas: [B, C] int32, the canvas a uniform-state decoder step read (DiffusionGemma: the noisy canvas its
    queries hold, which the final tokens do not show; zeros at its encoder calls), or [B, G] the generated
    tokens a step under a decoding rule read (`llada_rules`); None for the others.
  nonfinite: [B] bool, the call's logits (or hidden states) of the row hold a NaN or an infinity (set by
    `ModelCaller`; the conditional and, under CFG, the unconditional half).
  captures: the call's captured activations by name ([B, S | P, ...], the conditional half;
    `dlm_jax.instrument.hook_spec`), {} without hooks.
  committed: [B, G] bool, the generated positions the step committed a token to (the decoding rules of
    `dlm_jax.sampling.llada_rules`; None for the other samplers).
  revoked: [B, G] bool, the generated positions the step re-masked (WINO; all False for the other rules).
  computed: [B, S] bool, the sequence positions whose queries the call computed under a compute policy
    (`dlm_jax.policy`); None without one.
  keys_read: [B] float32, the keys each computed query read under a compute policy (mean over the layers);
    None without one. policy_record: the policy's `record` of its state after the call (None without one).
  """

  stats: dict[str, jax.Array] | None = None
  top_sinks: jax.Array | None = None
  record: Any = None
  active: jax.Array | None = None
  queries: jax.Array | None = None
  accepted: jax.Array | None = None
  canvas: jax.Array | None = None
  nonfinite: jax.Array | None = None
  captures: dict[str, Any] | None = None
  committed: jax.Array | None = None
  revoked: jax.Array | None = None
  computed: jax.Array | None = None
  keys_read: jax.Array | None = None
  policy_record: Any = None


def _nonfinite_rows(*arrays: jax.Array | None) -> jax.Array:
  """[B] bool: a row of any [B, ...] array holds a non-finite value (arrays of 2B rows fold onto B)."""
  rows = None
  for x in arrays:
    if x is None:
      continue
    bad = ~jnp.all(jnp.isfinite(x.reshape(x.shape[0], -1)), axis=1)
    rows = bad if rows is None else rows | bad
  return rows


@struct.dataclass
class CallResult:
  """Named result of `ModelCaller.__call__`.

  logits: [B, W, V] float32 of the conditional sequence; uncond_logits: the same for the unconditional one
  (CFG) or None. With `return_hidden` both are None and hidden / uncond_hidden hold the final-normed
  hidden states [B, W, D] instead (`dlm_jax.model.lm_head` turns a slice into logits).
  state: the `CallState` after the call; cache: the updated `KVCache` or None; outputs: the step's
  `StepOutput`.
  """

  logits: jax.Array | None
  uncond_logits: jax.Array | None
  hidden: jax.Array | None
  uncond_hidden: jax.Array | None
  state: CallState
  cache: KVCache | None
  outputs: StepOutput


def _span(computed: jax.Array) -> jax.Array:
  """[2] int32 [start, stop): the smallest range of positions holding every position computed [B, S] marks."""
  any_row = jnp.any(computed, axis=0)
  n = any_row.shape[0]
  start = jnp.argmax(any_row)
  stop = n - jnp.argmax(any_row[::-1])
  return jnp.where(jnp.any(any_row), jnp.stack([start, stop]), 0).astype(jnp.int32)


def _scalar(x) -> jax.Array | None:
  """x as a scalar int32 array (None stays None)."""
  return None if x is None else jnp.asarray(x, jnp.int32)


def _split_rows(tree, batch: int):
  """Rows [0, batch) of the batch axis (axis 1) of [L', 2B, ...] statistics."""
  return jax.tree.map(lambda x: x[:, :batch], tree)


def _run(forward_fn, config, attention_impl: str, query_chunk: int, params, tokens, *, positions, instruments,
         readout, **compute_fields) -> ForwardOutput:
  """forward_fn (`forward` or `row_by_row.forward_rows`) with the caller's config, attention path and params
  (bound by the caller); the other `Compute` fields (cache, cache_offset, decoder, subset) by keyword."""
  compute = Compute(attention_impl=attention_impl, query_chunk=query_chunk, **compute_fields)
  return forward_fn(params, tokens, config=config, positions=positions, instruments=instruments, readout=readout,
                    compute=compute)


def _double(x: jax.Array, axis: int) -> jax.Array:
  return jnp.concatenate([x, x], axis=axis)


@dataclasses.dataclass(frozen=True)
class ModelCaller:
  """The model call of a sampler run (static: part of the compiled program's key).

  Attributes:
    plan: the `CallPlan` (model config, statistics plan, intervention, hooks, compute policy).
    mask_id: mask token id for the sampler's query groups (None for models without one).
    gen_start: first generated position (for the query groups).
    attention_impl, query_chunk: passed to `forward`.
    batch_invariant: run the model one row at a time (`dlm_jax.sampling.row_by_row`), so that every row's
      logits and statistics are bitwise those of a batch of one.
  """

  plan: CallPlan
  mask_id: int | None
  gen_start: int
  attention_impl: str = "chunked"
  query_chunk: int = 128
  batch_invariant: bool = False

  @property
  def config(self):
    return self.plan.config

  def __call__(self, params, step, state: CallState, inputs: CallInputs, readout: Readout = Readout(),
               cache: CacheCall | None = None, guidance: Guidance | None = None) -> CallResult:
    """Runs the model on inputs.tokens [B, T] (with guidance's unconditional tokens as a 2B batch).

    step: the driver's step index (traced int32); state: the run's `CallState`; inputs, readout, cache,
    guidance: `dlm_jax.sampling.call_inputs`. Without a cache the T queries are the whole sequence the
    intervention sees; with one they sit at `cache.offset` of `cache.sequence` [B, S].
    """
    tokens = inputs.tokens
    batch, length = tokens.shape
    unresolved = inputs.unresolved
    if unresolved is None:
      unresolved = tokens == (-1 if self.mask_id is None else self.mask_id)
    known = dict(unresolved=unresolved, query_valid=inputs.query_valid, gen_start=self.gen_start,
                 block_start=_scalar(inputs.block_start), block_step=_scalar(inputs.block_step))
    offset = 0 if cache is None else cache.offset
    if cache is None:
      context = CallContext(step=jnp.asarray(step, jnp.int32), tokens=tokens, **known)
    else:
      context = CallContext(step=jnp.asarray(step, jnp.int32), tokens=cache.sequence, query_offset=cache.offset,
                            query_length=length, **known)
    call = self.plan.prepare(state, context, lambda: query_group_weights(unresolved, self.gen_start, offset),
                             inputs.query_valid)
    bias, weights, hooks = inputs.bias + call.bias, call.query_weights, call.hooks
    model_tokens, positions = tokens, inputs.positions
    if guidance is not None:
      bias = bias.concat_batch(guidance.bias + call.bias, batch)
      model_tokens = jnp.concatenate([tokens, guidance.tokens], axis=0)
      positions = _double(positions, 0)
      weights = None if weights is None else _double(weights, 0)
      hooks = None if hooks is None else hooks.map_rows(_double)
    window = (length - 1, length) if readout.window == "last" else readout.window
    instruments = CallInstruments(bias=bias, stats_spec=self.plan.stats.forward_spec, query_weights=weights,
                                  hooks=hooks)
    run = functools.partial(_run, row_by_row.forward_rows if self.batch_invariant else forward, self.config,
                            self.attention_impl, self.query_chunk, params)
    decision, family_cache = None, None
    if state.policy is not None:
      decision = self.plan.policy.decide(state.policy.state, context)
      if self.batch_invariant:  # each row at its own bucket: a row's last bits change with its row count
        decision = decision.replace(row_buckets=True)
      elif jnp.ndim(decision.full):  # a per-row full (key blocks) is the batch's: one program for all rows
        decision = decision.replace(full=jnp.any(decision.full))
      head = functools.partial(lm_head, params, config=self.config)
      confidence = Confidence(self.plan.policy.reads_max_probability,
                              functools.partial(row_by_row.lm_head_rows, head) if self.batch_invariant else head)
      if cache is None:
        output = policy_forward(run, state.policy, decision, model_tokens, positions, instruments,
                                readout.replace(window=window), confidence)
      else:  # the family keeps its exact cache (block diffusion): the policy chooses key subsets of it
        output = family_cache_forward(run, decision, cache.cache, offset, model_tokens, positions, instruments,
                                      readout.replace(window=window))
        family_cache, output = output.cache, output.replace(cache=state.policy.cache)
    else:
      output = run(model_tokens, positions=positions, instruments=instruments,
                   readout=readout.replace(window=window), cache=None if cache is None else cache.cache,
                   cache_offset=offset, decoder=None if cache is None else cache.decoder)
    halves = {"logits": output.logits, "hidden": output.hidden}
    cond = {name: None if x is None else x[:batch] for name, x in halves.items()}
    uncond = {name: None if x is None or guidance is None else x[batch:] for name, x in halves.items()}
    if guidance is not None:
      output = ForwardOutput(logits=cond["logits"], stats=_split_rows(output.stats, batch), cache=output.cache,
                             captures=jax.tree.map(lambda x: x[:batch], output.captures))
    state = self.plan.update(state, output, context, decision)
    stats = self.plan.stats
    nonfinite = _nonfinite_rows(cond["logits"], cond["hidden"], uncond["logits"], uncond["hidden"])
    computed, keys = None, None
    if decision is not None and cache is None:
      computed, keys = computed_positions(decision, batch, length), keys_read(decision, length)
    elif decision is not None:  # the call's T queries at offset; a full call reads the keys before their end
      n_seq = cache.sequence.shape[1]
      index = jnp.arange(n_seq)
      computed = jnp.broadcast_to((index >= offset) & (index < offset + length), (batch, n_seq))
      keys = jnp.where(decision.full, offset + length, keys_read(decision, n_seq)).astype(jnp.float32)
    outputs = StepOutput(stats=stats.user_stats(output, self.config),
                         top_sinks=stats.top_sinks(output, inputs.key_valid), record=call.record,
                         nonfinite=nonfinite, captures=output.captures,
                         computed=computed, queries=None if computed is None else _span(computed),
                         policy_record=None if decision is None else self.plan.policy.record(state.policy.state),
                         keys_read=None if keys is None else jnp.broadcast_to(keys, (batch,)))
    return CallResult(logits=cond["logits"], uncond_logits=uncond["logits"], hidden=cond["hidden"],
                      uncond_hidden=uncond["hidden"], state=state,
                      cache=output.cache if decision is None else family_cache, outputs=outputs)
