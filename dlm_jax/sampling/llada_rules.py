"""The LLaDA / MMaDA and Dream families under one of the decoding rules of `dlm_jax.sampling.decoding_rules`
(`LLaDAOptions.rule`): EB-Sampler, KLASS, WINO, PC-Sampler, certainty prior.

Blocks are LLaDA's ([Lp + kB, Lp + (k + 1)B)); each step's candidates are the masked positions of the
current block. Without a cache every call runs the whole sequence (exact attention) and the LM head on the G
generated positions; WINO's calls append the block's verification copy (S + B positions, module docstring
of `decoding_rules`). The run is one driver phase with the block and its step counter in the carry, so it
compiles once whatever the number of blocks.

KV caches (`options.cache`, not with WINO), in Research dLLM's order of operations (Kamichanw/d2Cache: the
rule's step is unchanged, the cache serves its model calls): a block's first call runs the whole sequence
and keeps every layer's keys and values (the refresh; it commits by the rule like any step); the block's
later calls compute the queries [s − shift, S − shift) ("prefix") or [s − shift, e − shift) ("dual"), shift
Dream's 1, writing their fresh keys and values in place and reading all S cached positions. The logits of
a generated position no query of the call predicts are zeros (as Research dLLM scatters them), so KLASS's
distribution there is uniform and enters its KL history as such. The dual cache keeps the one-phase layout
(a `lax.cond` picks the refresh at a block's first step); the prefix cache's query count changes with the
block, so each block is a phase opened by its refresh. Classifier-free guidance (LLaDA's `cfg_scale`, no
cache, not WINO): every rule reads the guided logits un + (w + 1)·(cond − un).

Steps per block (the phase bound is num_blocks × this):

  * EB, WINO: until the block holds no mask, at most B calls (each commits at least one token net);
  * KLASS: at most steps / num_blocks calls, fewer when the block is done (the original's `break`); its
    Dream code ("dream_klass", Dream's default): one block, at most min(steps, gen_length) calls (each commits
    at least one token), fewer when no mask is left;
  * PC-Sampler, certainty prior: steps / num_blocks calls, each committing the LLaDA schedule's quota.

In a batch the rows move to the next block together; a row whose block is done waits (unchanged,
`Trace.active_rows` False, its key, KLASS history and WINO counter not advanced), so its tokens and
`row_nfe` are those it gets alone.

Statistics: WINO's calls hold S + B positions (the verification copy after the sequence); its statistics
are cut to the sequence's S keys (the sequence's queries never see the copy's keys) and its top sinks are
chosen among them, while the copy's B queries are part of the call and their attention to the sequence is
in the sums (`Trace.computed_queries` says [0, S + B)); routing keeps the sequence's positions. Dream reads
the call's outputs one position earlier, the copy's included, as Research dLLM's `wino.py` (`decoding_rules`
module docstring).

Each step reports the positions it committed and (WINO) re-masked (`StepOutput.committed` / `revoked`,
stacked into `Trace.committed` / `Trace.revoked` [max_steps, B, G]) and the generated tokens it read
(`StepOutput.canvas`, `Trace.canvases` [max_steps, B, G]: a revoked draft shows there until its re-mask);
`decode_step` is the last commit.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from dlm_jax.config import logit_shift
from dlm_jax.instrument.interventions import NO_INTERVENTION, padding_bias
from dlm_jax.core.attention_bias import MASK_VALUE, AttentionBias
from dlm_jax.sampling import decoding_rules as dr
from dlm_jax.model import KVCache
from dlm_jax.sampling.call_inputs import CacheCall, CallInputs, Guidance, Readout
from dlm_jax.sampling import blocks, driver, keys, padding
from dlm_jax.sampling.schedules import llada_transfer_counts
from dlm_jax.sampling.selection import select_top_k, update_decode_step

WINO_FIRST_LAST_DRAFTED = 30
"""WINO's draft count of the 'previous step' at a block's first step (the authors' `last_accept = 30`)."""


@struct.dataclass
class RuleCarry:
  """tokens [B, S]; key; decode_step [B, G]; block, block_step: the current block and its steps so far;
  schedule [B, steps_per_block]: the block's quota (set at its first step); rule state: p_prev [B, G, V]
  and kl_history [B, G, h] (KLASS), last_drafted [B] (WINO), else None; cache: the `KVCache` (prefix / dual)."""

  tokens: jax.Array
  key: jax.Array
  decode_step: jax.Array
  block: jax.Array
  block_step: jax.Array
  schedule: jax.Array
  p_prev: jax.Array | None = None
  kl_history: jax.Array | None = None
  last_drafted: jax.Array | None = None
  cache: KVCache | None = None


@struct.dataclass
class RuleConstants:
  """Loop invariants: the padding layout, (PC-Sampler) the corpus prior's frequencies [V] float32 and (LLaDA's
  CFG) the unconditional sequence's padding bias and the prompt index [B, S] (`llada.LLaDAConstants`)."""

  layout: padding.PaddingLayout
  prior: jax.Array | None = None
  uncond_bias: AttentionBias | None = None
  prompt_index: jax.Array | None = None


def constants(family, base) -> RuleConstants:
  """The family's constants `base` (LLaDA's, or Dream's `PaddingLayout`) reduced to the layout and CFG's fields,
  with the prior added."""
  rule = family.options.rule
  prior = jnp.asarray(rule.prior.frequencies, jnp.float32) if isinstance(rule, dr.PCSampler) else None
  if isinstance(base, padding.PaddingLayout):
    return RuleConstants(layout=base, prior=prior)
  return RuleConstants(layout=base.layout, prior=prior, uncond_bias=base.uncond_bias, prompt_index=base.prompt_index)


def check(family, config, intervention) -> None:
  """Refuses, in one line, a model or intervention the rule cannot run with: a PC prior for another vocabulary
  size; an intervention or hooks under WINO (its calls hold S + B positions, which they do not address)."""
  rule = family.options.rule
  if isinstance(rule, dr.WINO) and intervention != NO_INTERVENTION:
    raise ValueError("decoding rule wino runs its calls on the sequence plus a verification copy of the block; "
                     "interventions and hooks are not supported with it (statistics are).")
  if isinstance(rule, dr.PCSampler) and rule.prior.vocab_size != config.vocab_size:
    raise ValueError(f"pc prior is for a vocabulary of {rule.prior.vocab_size} ids, the model has "
                     f"{config.vocab_size}; compute one for this tokenizer.")


def check_policy(family, name: str) -> None:
  """Refuses (one line) compute policy `name` under WINO: its calls append the block's verification copy (S + B
  positions, which the policy's cache of the S positions does not hold) and it re-masks decoded tokens, which a
  policy that caches decoded positions' keys and values (dkv_cache) would then never recompute; and with a KV
  cache: the rules' cached calls are their own (Research dLLM's order), which no policy emulates
  (`blocks.CACHE_POLICIES` compose with the Fast-dLLM modes only)."""
  if isinstance(family.options.rule, dr.WINO):
    raise ValueError(f"policy {name!r} does not run with decoding rule wino: its calls append a verification copy "
                     "of the block and it re-masks decoded tokens; use eb, klass, pc or certainty_prior with it.")
  if family.options.cache != "none":
    raise ValueError(f"policy {name!r} does not run with a decoding rule and cache={family.options.cache!r}; use "
                     "cache='none' with the rule (sparse_dllm composes with the caches of the threshold and factor "
                     "modes).")


def klass_variant(family) -> str | None:
  """The KLASS variant the family runs (`decoding_rules.KLASS.variant_on`), None under another rule."""
  rule = family.options.rule
  return rule.variant_on(family.dream_klass_default) if isinstance(rule, dr.KLASS) else None


def bound(family) -> int:
  """The most calls a block takes under the family's rule (module docstring)."""
  options = family.options
  if isinstance(options.rule, (dr.EBSampler, dr.WINO)):
    return options.block
  if klass_variant(family) == "dream_klass":
    return min(options.steps_per_block, options.block)
  return options.steps_per_block


def _rows(array, start, length):
  return jax.lax.dynamic_slice_in_dim(array, start, length, axis=1)


def _wino_bias(layout: padding.PaddingLayout, total: int, block: int, block_start) -> AttentionBias:
  """The verification call's attention: the S sequence queries see the S sequence keys (not the copy); copy
  query j sees every sequence key but its twin block_start + j, and every copy key; plus the padding bias:
  a key bias extended with zeros over the copy, or (Dream's "outer" padding) the outer product of the
  validity extended with the copy's B always-valid positions. -> pairwise [1 | B, 1, S + B, S + B]."""
  n = total + block
  q = jnp.arange(n)[:, None]
  k = jnp.arange(n)[None, :]
  copy_q, copy_k = q >= total, k >= total
  twin = copy_q & (k == block_start + (q - total))
  allowed = jnp.where(copy_q, ~twin, ~copy_k)
  bias = AttentionBias(pairwise=jnp.where(allowed, 0.0, MASK_VALUE).astype(jnp.float32)[None, None])
  if layout.bias.pairwise is not None:
    valid = jnp.concatenate([layout.valid, jnp.ones((layout.valid.shape[0], block), bool)], axis=1)
    return bias + padding_bias(valid, outer=True)
  if layout.bias.keys is not None:
    keys = layout.bias.keys
    return bias.replace(keys=jnp.pad(keys, [(0, 0)] * (keys.ndim - 1) + [(0, block)]))
  return bias


def _call(family, run, params, consts, carry, istate, i, s, block_step, call: str):
  """The step's model call: (CallResult with the generated positions' logits [B, G (+ B for WINO), V] — for a
  model with shifted logits (Dream) the outputs one position earlier, `dlm_jax.config.logit_shift`; under CFG
  the guided logits — and queries [2]). s: the current block's first position (static for "prefix");
  block_step: the calls it has had before this one; call: "full" (no cache), "refresh", "prefix" or "dual"
  (module docstring)."""
  o, lp, total, layout, x = family.options, run.prompt_length, run.total_length, consts.layout, carry.tokens
  if isinstance(o.rule, dr.WINO):
    return _wino_call(family, run, params, consts, x, istate, i, s)
  shift = run.config.logit_shift
  if call in ("full", "refresh"):
    guided = getattr(o, "cfg_scale", 0.0) > 0
    guidance = Guidance(jnp.where(consts.prompt_index, family.mask_id, x), consts.uncond_bias) if guided else None
    cache = CacheCall(carry.cache, 0, x) if call == "refresh" else None
    result = run.caller(params, i, istate, CallInputs(x, layout.positions, layout.valid, layout.valid, layout.bias,
                                                      block_start=s, block_step=block_step),
                        Readout(window=logit_shift.output_window(lp, total, shift)), cache, guidance)
    logits = logit_shift.target_logits(result.logits, lp, shift)
    if guided:
      uncond = logit_shift.target_logits(result.uncond_logits, lp, shift)
      logits = uncond + (o.cfg_scale + 1.0) * (logits - uncond)
    return result.replace(logits=logits, uncond_logits=None), jnp.array([0, total], jnp.int32)
  start = s - shift
  length = total - s if call == "prefix" else o.block
  inputs = CallInputs(_rows(x, start, length), _rows(layout.positions, start, length),
                      _rows(layout.valid, start, length), layout.valid, padding.query_rows(layout.bias, start, length),
                      block_start=s, block_step=block_step)
  result = run.caller(params, i, istate, inputs, Readout(window=(0, length)), CacheCall(carry.cache, start, x))
  empty = jnp.zeros((x.shape[0], o.gen_length, result.logits.shape[-1]), result.logits.dtype)
  logits = jax.lax.dynamic_update_slice_in_dim(empty, result.logits, s - lp, axis=1)
  queries = jnp.stack([jnp.asarray(start, jnp.int32), jnp.asarray(start + length, jnp.int32)])
  return result.replace(logits=logits), queries


def _wino_call(family, run, params, consts, x, istate, i, s):
  """WINO's call on the sequence plus the block's verification copy (`_call`)."""
  o, lp, total, layout = family.options, run.prompt_length, run.total_length, consts.layout
  if run.caller.plan.intervention != NO_INTERVENTION:
    raise ValueError("decoding rule wino runs its calls on the sequence plus a verification copy of the block; "
                     "interventions and hooks are not supported with it (statistics are).")
  b = x.shape[0]
  tokens = jnp.concatenate([x, jnp.full((b, o.block), family.mask_id, x.dtype)], axis=1)
  positions = jnp.concatenate([layout.positions, _rows(layout.positions, s, o.block)], axis=1)
  valid = jnp.concatenate([layout.valid, _rows(layout.valid, s, o.block)], axis=1)
  sequence_keys = jnp.concatenate([layout.valid, jnp.zeros((b, o.block), bool)], axis=1)
  shift = run.config.logit_shift
  result = run.caller(params, i, istate, CallInputs(tokens, positions, valid, sequence_keys,
                                                    _wino_bias(layout, total, o.block, s)),
                      Readout(window=(lp - shift, total + o.block - shift)))
  outputs = result.outputs.replace(stats=_sequence_stats(result.outputs.stats, total, o.block))
  return result.replace(outputs=outputs), jnp.array([0, total + o.block], jnp.int32)


def _model_call(family, run, params, consts, carry, istate, i, s, block_step, call: str | None):
  """`_call` with the call the cache asks for: call given (the prefix cache's phases: "refresh" or "prefix"),
  or from the options — "full" without a cache, the dual cache's refresh at a block's first call and its
  block call after (a `lax.cond`)."""
  if call is not None:
    return _call(family, run, params, consts, carry, istate, i, s, block_step, call)
  if family.options.cache == "none":
    return _call(family, run, params, consts, carry, istate, i, s, block_step, "full")
  return jax.lax.cond(block_step == 0,
                      lambda: _call(family, run, params, consts, carry, istate, i, s, block_step, "refresh"),
                      lambda: _call(family, run, params, consts, carry, istate, i, s, block_step, "dual"))


def _sequence_stats(stats, total: int, block: int):
  """WINO's statistics on the sequence's S positions: every [..., S + B] key axis keeps its first S entries
  (the sequence's queries never see the copy's keys; the copy's queries' attention to the sequence stays in
  the sums), the [L', B, S + B, k] routing axis its first S (expert_load still counts the copy)."""
  if stats is None:
    return None

  def cut(name, a):
    if name in ("routed_experts", "routing_weights"):
      return a[..., :total, :]
    return a[..., :total] if a.shape[-1] == total + block else a

  return {name: cut(name, a) for name, a in stats.items()}


def step(family, run, params, consts, carry: RuleCarry, istate, i, block=None, call: str | None = None):
  """One decoding step under options.rule (module docstrings); block: the current block when static (the
  prefix cache's phases; else the carry's), call: `_model_call`'s. Returns (carry, istate, StepOutput)."""
  o, mask_id, lp, rule = family.options, family.mask_id, run.prompt_length, family.options.rule
  g = o.gen_length
  x = carry.tokens
  gen = x[:, lp:]
  block_start = (carry.block if block is None else block) * o.block
  position = jnp.arange(g)[None, :]
  in_block = (position >= block_start) & (position < block_start + o.block)
  candidates = (gen == mask_id) & in_block
  active = jnp.any(candidates, axis=1)
  fresh = carry.block_step == 0
  schedule = jnp.where(fresh, llada_transfer_counts(jnp.sum(candidates, axis=1), o.steps_per_block), carry.schedule)
  quota = jax.lax.dynamic_index_in_dim(schedule, jnp.minimum(carry.block_step, o.steps_per_block - 1), axis=1,
                                       keepdims=False)
  key, step_key = keys.split(carry.key, 2, run.row_keys)
  if run.row_keys:
    key = keys.keep_rows(active, key, carry.key)

  result, queries = _model_call(family, run, params, consts, carry, istate, i, lp + block_start, carry.block_step,
                                call)
  logits = result.logits[:, :g]
  revoked = jnp.zeros_like(candidates)
  updates = {}
  if isinstance(rule, dr.KLASS):
    p = jax.nn.softmax(logits.astype(jnp.promote_types(logits.dtype, jnp.float32)), axis=-1)
    x0 = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    confidence = jnp.take_along_axis(p, x0[..., None], axis=-1)[..., 0]
    history = jnp.concatenate([carry.kl_history[..., 1:], dr.kl_divergence(p, carry.p_prev)[..., None]], axis=-1)
    if klass_variant(family) == "dream_klass":
      ranking = family._proposals(params, logits, None, step_key, run.row_keys)[1]  # pylint: disable=protected-access
      chosen = dr.dream_klass_transfer(confidence, history, candidates, ranking, rule)
    else:
      chosen = dr.klass_transfer(confidence, history, candidates, carry.block_step, quota, rule,
                                 family.klass_ranking(logits))
    keep = active[:, None, None]
    updates = dict(p_prev=jnp.where(keep, p, carry.p_prev), kl_history=jnp.where(keep, history, carry.kl_history))
  elif isinstance(rule, dr.WINO):
    p = jax.nn.softmax(logits.astype(jnp.promote_types(logits.dtype, jnp.float32)), axis=-1)
    x0 = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    confidence = jnp.take_along_axis(p, x0[..., None], axis=-1)[..., 0]
    chosen = dr.wino_draft(confidence, candidates, rule.wide_in)
    copy = jax.nn.softmax(result.logits[:, g:].astype(p.dtype), axis=-1)
    current = _rows(gen, block_start, o.block)
    back = jnp.take_along_axis(copy, current[..., None], axis=-1)[..., 0]
    back = jax.lax.dynamic_update_slice_in_dim(jnp.full(gen.shape, jnp.inf, back.dtype), back, block_start, axis=1)
    decoded = in_block & (gen != mask_id)
    last = jnp.where(fresh, WINO_FIRST_LAST_DRAFTED, carry.last_drafted)
    drafted = jnp.sum(chosen, axis=1).astype(jnp.int32)
    revoked = dr.wino_remask(back, decoded, drafted, last, rule.narrow_out)
    updates = dict(last_drafted=jnp.where(active, drafted, carry.last_drafted))
  else:
    x0, confidence = family._proposals(params, logits, None, step_key, run.row_keys)
    if isinstance(rule, dr.EBSampler):
      chosen = dr.eb_transfer(dr.entropy(logits), candidates, rule.gamma)
    else:
      if isinstance(rule, dr.PCSampler):
        scores = dr.pc_scores(confidence, x0, consts.prior, block_start, rule)
      else:
        scores = confidence * dr.certainty_density(gen != mask_id, rule.sigma)
      chosen = select_top_k(jnp.where(candidates, scores, -jnp.inf),
                            jnp.minimum(quota, jnp.sum(candidates, axis=1))) & candidates
  chosen = chosen & candidates
  new_gen = jnp.where(revoked, mask_id, jnp.where(chosen, x0, gen))
  new_x = jnp.concatenate([x[:, :lp], new_gen], axis=1)
  decode_step = update_decode_step(carry.decode_step, gen, new_gen, mask_id, i)
  block_step = carry.block_step + 1
  left = jnp.any((new_gen == mask_id) & in_block)
  block_over = ~left | (block_step >= bound(family))
  if isinstance(rule, (dr.PCSampler, dr.CertaintyPrior)):
    block_over = block_step >= bound(family)
  carry = carry.replace(tokens=new_x, key=key, decode_step=decode_step, schedule=schedule,
                        block=carry.block + block_over.astype(jnp.int32),
                        block_step=jnp.where(block_over, 0, block_step),
                        cache=carry.cache if result.cache is None else result.cache, **updates)
  outputs = result.outputs.replace(active=active, queries=queries, committed=chosen, revoked=revoked, canvas=gen)
  return carry, result.state, outputs


@dataclasses.dataclass(frozen=True)
class RuleFamilyMixin:
  """The driver methods of a LLaDA family run under a decoding rule (mixed into `llada.LLaDARuleFamily`)."""

  can_finish_early = True
  dream_klass_default = False
  """Whether KLASS with no variant set runs KLASS's Dream code ("dream_klass"; Dream's family) rather than its
  LLaDA code."""

  def phases(self, run) -> tuple[driver.Phase, ...]:
    """One phase, or with the prefix cache one per block opened by its refresh (`blocks.phases`)."""
    return blocks.phases(self.options.cache, self.options.num_blocks, bound(self))

  def init_carry(self, run, params, sequence, key, consts) -> RuleCarry:
    b, o = sequence.shape[0], self.options
    state = {}
    if isinstance(o.rule, dr.KLASS):
      dtype = jnp.promote_types(params["embed"]["embedding"].dtype, jnp.float32)
      state = dict(p_prev=jnp.zeros((b, o.gen_length, run.config.vocab_size), dtype),
                   kl_history=jnp.zeros((b, o.gen_length, o.rule.kl_history_length), dtype))
    if isinstance(o.rule, dr.WINO):
      state = dict(last_drafted=jnp.full((b,), WINO_FIRST_LAST_DRAFTED, jnp.int32))
    return RuleCarry(tokens=sequence, key=key, decode_step=jnp.full((b, o.gen_length), -1, jnp.int32),
                     block=jnp.zeros((), jnp.int32), block_step=jnp.zeros((), jnp.int32),
                     schedule=jnp.zeros((b, o.steps_per_block), jnp.int32), cache=blocks.init_cache(run, params, b),
                     **state)

  def finished(self, run, consts, carry: RuleCarry, i, phase):
    """Every block done, or (the prefix cache's phases) the phase's block."""
    if phase.arg is None:
      return carry.block >= self.options.num_blocks
    return carry.block != phase.arg

  def open_phase(self, run, params, consts, carry: RuleCarry, istate, i, phase):
    """The prefix cache's block opening: the refresh."""
    return step(self, run, params, consts, carry, istate, i, phase.arg, "refresh")

  def step(self, run, params, consts, carry: RuleCarry, istate, i, phase):
    if phase.arg is None:
      return step(self, run, params, consts, carry, istate, i)
    return step(self, run, params, consts, carry, istate, i, phase.arg, "prefix")

  def block_index(self, run, before, after, i, phase_index):
    return driver.Family.block_index(self, run, before, after, i, phase_index)

  def klass_ranking(self, logits) -> jax.Array | None:
    """KLASS's fallback ranking [B, G] when it is not the gate's p(x0) (`decoding_rules.klass_transfer`): None."""
    del logits
    return None
