"""One model evaluation of a sampler step: padding bias + intervention → forward → statistics per plan.

CFG. With classifier-free guidance the conditional and unconditional sequences run as one 2B batch (one
model evaluation: `nfe` counts forward calls). Statistics, top sinks and the intervention's `update`
see the conditional half only; the intervention's bias is applied to both halves.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from dlm_jax.core.attention_bias import NO_BIAS, AttentionBias
from dlm_jax.config import ModelConfig
from dlm_jax.instrument.interventions import CallContext, Intervention
from dlm_jax.instrument.stats import ForwardOutput, query_group_weights
from dlm_jax.model import DecoderCall, KVCache, forward
from dlm_jax.sampling import row_by_row
from dlm_jax.sampling.stats_plan import StatsPlan


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
    that compute part of the sequence; the driver fills [0, S) when None).
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
  intervention_state: the state after `update`; cache: the updated `KVCache` or None; outputs: the
  step's `StepOutput`.
  """

  logits: jax.Array | None
  uncond_logits: jax.Array | None
  hidden: jax.Array | None
  uncond_hidden: jax.Array | None
  intervention_state: Any
  cache: KVCache | None
  outputs: StepOutput


def _split_rows(tree, batch: int):
  """Rows [0, batch) of the batch axis (axis 1) of [L', 2B, ...] statistics."""
  return jax.tree.map(lambda x: x[:, :batch], tree)


@dataclasses.dataclass(frozen=True)
class ModelCaller:
  """The model call of a sampler run (static: part of the compiled program's key).

  Attributes:
    config: model config.
    plan: the statistics plan (`dlm_jax.sampling.stats_plan.StatsPlan`).
    intervention: the attention-bias intervention.
    mask_id: mask token id for the sampler's query groups (None for models without one).
    gen_start: first generated position (for the query groups).
    attention_impl, query_chunk: passed to `forward`.
    record_intervention: also return the intervention's per-call record.
    batch_invariant: run the model one row at a time (`dlm_jax.sampling.row_by_row`), so that every row's
      logits and statistics are bitwise those of a batch of one.
  """

  config: ModelConfig
  plan: StatsPlan
  intervention: Intervention
  mask_id: int | None
  gen_start: int
  attention_impl: str = "chunked"
  query_chunk: int = 128
  record_intervention: bool = False
  batch_invariant: bool = False

  def __call__(self, params, tokens: jax.Array, step, istate, *, window: tuple[int, int] | str | None,
               positions: jax.Array, valid_keys: jax.Array, query_valid: jax.Array,
               base_bias: AttentionBias = NO_BIAS,
               uncond_tokens: jax.Array | None = None, uncond_base_bias: AttentionBias = NO_BIAS,
               cache: KVCache | None = None, cache_offset: jax.Array | int = 0, sequence: jax.Array | None = None,
               logits_offset: jax.Array | int = 0, return_hidden: bool = False,
               decoder: DecoderCall | None = None, unresolved: jax.Array | None = None) -> CallResult:
    """Runs the model on tokens [B, T] (with the unconditional sequence [B, T] as a 2B batch when given).

    window: (start, stop) positions whose logits are computed, "last" (the last position) or None (all);
    logits_offset shifts it by a traced amount (see `dlm_jax.model.forward`); return_hidden: return the
    window's hidden states instead of its logits.
    positions: [B, T] RoPE positions; valid_keys: [B, S] keys the top sinks may be chosen among;
    query_valid: [B, T] the real (not padding) queries, the ones the statistics sum over.
    base_bias / uncond_base_bias: the padding biases of the two halves.
    cache: a `KVCache`: the call writes it at `cache_offset`, the keys are its S positions and `sequence`
    [B, S] is the whole sequence the intervention sees (`CallContext.tokens`).
    decoder: a `DecoderCall` for a DiffusionGemma decoder call (reads the cache, writes nothing; see
    `dlm_jax.model.forward`).
    unresolved: [B, T] bool, the queries of the masked query group (`dlm_jax.instrument.stats.QUERY_GROUP_NAMES`);
    default: those holding the mask token (none without a mask id).
    """
    batch, length = tokens.shape
    if unresolved is None:
      unresolved = tokens == (-1 if self.mask_id is None else self.mask_id)
    known = dict(unresolved=unresolved, query_valid=query_valid, gen_start=self.gen_start)
    if cache is None:
      context = CallContext(step=jnp.asarray(step, jnp.int32), tokens=tokens, **known)
    else:
      context = CallContext(step=jnp.asarray(step, jnp.int32), tokens=sequence, query_offset=cache_offset,
                            query_length=length, **known)
    record = self.intervention.record(istate) if self.record_intervention else None
    intervention_bias = self.intervention.bias(istate, context)
    hooks = self.intervention.hook_call(istate, context)
    bias = base_bias + intervention_bias
    spec = self.plan.forward_spec
    weights = None
    if spec.query_groups:
      weights = self.plan.query_weights(
          lambda: query_group_weights(unresolved, self.gen_start, cache_offset),
          lambda: self.intervention.query_weights(istate, context), query_valid)
    model_tokens = tokens
    if uncond_tokens is not None:
      bias = bias.concat_batch(uncond_base_bias + intervention_bias, batch)
      model_tokens = jnp.concatenate([tokens, uncond_tokens], axis=0)
      positions = jnp.concatenate([positions, positions], axis=0)
      if weights is not None:
        weights = jnp.concatenate([weights, weights], axis=0)
      if hooks is not None:  # the unconditional rows get the same edits at the same positions
        hooks = hooks.map_rows(lambda x, axis: jnp.concatenate([x, x], axis=axis))
    if window == "last":
      window = (length - 1, length)
    call = row_by_row.forward_rows if self.batch_invariant else forward
    output = call(params, model_tokens, config=self.config, bias=bias, positions=positions,
                  query_weights=weights, stats_spec=spec, logits_window=window, logits_offset=logits_offset,
                  attention_impl=self.attention_impl, query_chunk=self.query_chunk, cache=cache,
                  cache_offset=cache_offset, return_hidden=return_hidden, decoder=decoder, hooks=hooks)
    halves = {"logits": output.logits, "hidden": output.hidden}
    cond = {name: None if x is None else x[:batch] for name, x in halves.items()}
    uncond = {name: None if x is None or uncond_tokens is None else x[batch:] for name, x in halves.items()}
    if uncond_tokens is not None:
      output = ForwardOutput(logits=cond["logits"], stats=_split_rows(output.stats, batch), cache=output.cache,
                             captures=jax.tree.map(lambda x: x[:batch], output.captures))
    istate = self.intervention.update(istate, self.plan.intervention_output(output), context)
    nonfinite = _nonfinite_rows(cond["logits"], cond["hidden"], uncond["logits"], uncond["hidden"])
    outputs = StepOutput(stats=self.plan.user_stats(output, self.config.n_experts),
                         top_sinks=self.plan.top_sinks(output, valid_keys), record=record, nonfinite=nonfinite, captures=output.captures)
    return CallResult(logits=cond["logits"], uncond_logits=uncond["logits"], hidden=cond["hidden"],
                      uncond_hidden=uncond["hidden"], intervention_state=istate, cache=output.cache,
                      outputs=outputs)
