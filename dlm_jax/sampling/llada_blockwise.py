"""The LLaDA / MMaDA family's block-by-block modes (`reference/decoding_modes.md` §2–§5): Fast-dLLM
confidence-threshold and factor parallel decoding, and the prefix and dual KV caches, in any combination.

`LLaDAOptions.threshold` / `factor` choose the transfer rule (`dlm_jax.sampling.parallel`; neither = the
per-step quota of the exact sampler) and `LLaDAOptions.cache` the model calls. The blocks are the same as
the exact sampler's ([Lp + kB, Lp + (k + 1)B), after the prompt) and at each step the candidates are the
masked positions of the current block only. Without a cache and with the dual cache every call has fixed
shapes, so the whole run is one driver phase with the block index in the carry (a `lax.cond` picks the
refresh at a block's first step); the prefix cache computes S − s queries, a count that changes with the
block, so each of its blocks is a phase of its own (compile time grows with the number of blocks).

Model calls in block k = [s, e):
  * "none":   every step runs the whole sequence (exact attention); the logits are the block's.
  * "prefix": the block's first step runs the whole sequence and keeps every layer's keys and values (the
              refresh); the other steps run the queries [s, S) — the block and every later position —
              attending to the cached keys and values of [0, s) and to their own fresh ones.
  * "dual":   the same refresh; the other steps run the block's queries only, writing the block's fresh
              keys and values into the cache in place and attending to all S cached positions (prefix and
              later blocks as of the refresh).
  Both caches are approximations of exact decoding: in a bidirectional model the cached keys and values
  would change as the block's tokens are decoded. Keys and values are cached after RoPE at their
  absolute positions (the originals cache them before and rotate on every call; the results are equal).

Steps per block. With the quota rule a block takes steps / num_blocks steps, as exact decoding. With a
threshold or factor, a block takes as many steps as it needs (at least one token per step, so at most B);
the block's completion is tested before each call (as the later Fast-dLLM code; the June-2025 version
tested after, making one extra call when the refresh step had already finished the block). A block still
unfinished after B steps (possible only when the most confident proposal is the mask token itself) is
left with its masks. In a batch the rows move to the next block together: a row whose block is done waits
(unchanged, `Trace.active_rows` False, its key and its intervention state not advanced —
`Intervention.keep_rows`) while the others finish, so its tokens and `row_nfe` are those it gets alone.

Elastic-Cache's decoding (`LLaDAOptions.window`, `eos_truncation`; `dlm_jax.sampling.sliding_window`): the
candidates are the first `window` masks of the block, and after the first step that decodes the EOS id the masks
after that EOS are no longer candidates; the run ends when no row has a candidate left.

Under a compute policy that composes with a cache (`blocks.CACHE_POLICIES`, Sparse-dLLM) every call hands the
model the whole sequence and the policy's decisions make the cache's calls (its refresh, its query window, its
key subset; `dlm_jax.policy.policies.SparseDLLM`), reading the policy's KV cache.

Not supported (a clear error): classifier-free guidance with a cache (the unconditional sequence would need
a cache of its own; Fast-dLLM has no CFG).
"""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp

from dlm_jax.sampling import blocks, driver, keys, padding, sliding_window
from dlm_jax.sampling.call_inputs import CacheCall, CallInputs, Guidance, Readout
from dlm_jax.sampling.parallel import factor_transfer, threshold_transfer
from dlm_jax.sampling.schedules import llada_transfer_counts
from dlm_jax.sampling.selection import select_top_k, update_decode_step

Call = Literal["full", "refresh", "prefix", "dual"]


def _capped(options) -> bool:
  """The dual cache with NVlabs' current per-block cap (`LLaDAOptions.dual_cache_forwards`)."""
  return options.cache == "dual" and options.dual_cache_forwards == "steps_per_block"


def _bound(options) -> int:
  """The most steps a block takes: its quota steps (also under the capped dual cache), or B with a threshold
  or factor."""
  if _capped(options) or (options.threshold is None and options.factor is None):
    return options.steps_per_block
  return options.block


def phases(options) -> tuple[driver.Phase, ...]:
  """`blocks.phases` with this family's per-block bound."""
  return blocks.phases(options.cache, options.num_blocks, _bound(options))


init_cache = blocks.init_cache


def _block_index(carry, phase: driver.Phase):
  """The current block: static for a per-block phase, else the carry's (traced)."""
  return carry.block if phase.arg is None else phase.arg


def finished(family, run, carry, phase: driver.Phase) -> jax.Array:
  """Skip the call: the block is done for every row (per-block phases), every block is done (the one-phase
  layout), or (MMaDA's stop id) at a block start every row's previous position holds the stop id."""
  o = family.options
  k = _block_index(carry, phase)
  s = run.prompt_length + k * o.block
  if phase.arg is None:
    done = carry.block >= o.num_blocks
    if o.eos_truncation:
      after = jnp.arange(run.total_length)[None, :] >= s
      done = done | ~jnp.any(decodable(family, run, carry.tokens, carry.decode_step) & after)
    at_start = (carry.block_step == 0) & (k > 0)
  else:
    done = ~jnp.any(_rows(decodable(family, run, carry.tokens, carry.decode_step), s, o.block))
    at_start = jnp.asarray(phase.arg > 0)
  if o.stop_token_id is not None:
    previous = jax.lax.dynamic_index_in_dim(carry.tokens, jnp.maximum(s - 1, 0), axis=1, keepdims=False)
    done = done | (at_start & jnp.all(previous == o.stop_token_id))
  return done


def decodable(family, run, tokens, decode_step) -> jax.Array:
  """[B, S] bool: the positions holding the mask token that may still be decoded — all of them, or with
  `LLaDAOptions.eos_truncation` those before the EOS cut (`sliding_window.eos_cut`)."""
  masked = tokens == family.mask_id
  if not family.options.eos_truncation:
    return masked
  lp = run.prompt_length
  keep = sliding_window.before_cut(tokens[:, lp:], decode_step, family.eos_id)
  return masked & jnp.concatenate([jnp.ones((tokens.shape[0], lp), bool), keep], axis=1)


def _candidates(family, run, tokens, decode_step, s) -> jax.Array:
  """[B, block] bool: the step's candidates, the decodable masks of block s — with `LLaDAOptions.window` the
  first `window` of them (`dlm_jax.sampling.sliding_window`)."""
  o = family.options
  return sliding_window.first_masks(_rows(decodable(family, run, tokens, decode_step), s, o.block), o.window)


def _transfer(family, confidence, candidates, schedule, block_step):
  options, scale = family.options, family.confidence_scale
  if options.factor is not None:
    return factor_transfer(confidence, candidates, options.factor, options.factor_rule, scale)
  if options.threshold is not None:
    return threshold_transfer(confidence, candidates, options.threshold, scale)
  count = jax.lax.dynamic_index_in_dim(schedule, block_step, axis=1, keepdims=False)
  return select_top_k(jnp.where(candidates, confidence, -jnp.inf), count) & candidates


def _rows(array, start, length):
  return jax.lax.dynamic_slice_in_dim(array, start, length, axis=1)


def _model_call(family, run, params, consts, carry, istate, i, s, call: Call, step_key, block_step):
  """The step's model call: (CallResult with the block's logits [B, block, V] — the whole sequence's [B, S, V]
  at a refresh of the capped dual cache — queries [2]). block_step: the calls block s has had before this one."""
  o, total, x, layout = family.options, run.total_length, carry.tokens, consts.layout
  if call == "prefix":
    start, length = s, total - s
  elif call == "dual":
    start, length = s, o.block
  else:
    start, length = 0, total
  uncond = jnp.where(consts.prompt_index, family.mask_id, x) if o.cfg_scale > 0 else None
  cache = None if call == "full" else carry.cache
  whole = call in ("full", "refresh")
  sequence_logits = call == "refresh" and _capped(o)
  inputs = CallInputs(x if whole else _rows(x, start, length), _rows(layout.positions, start, length),
                      _rows(layout.valid, start, length), layout.valid,
                      padding.query_rows(layout.bias, start, length), block_start=s, block_step=block_step)
  readout = Readout(window=(0, total) if sequence_logits else (0, o.block),
                    offset=s if whole and not sequence_logits else 0)
  result = run.caller(params, i, istate, inputs, readout, None if cache is None else CacheCall(cache, start, x),
                      None if uncond is None else Guidance(uncond, consts.uncond_bias))
  queries = jnp.stack([jnp.asarray(start, jnp.int32), jnp.asarray(start + length, jnp.int32)])
  return result, queries


def _queries(result, queries: jax.Array) -> jax.Array:
  """The step's [start, stop) computed queries: the cache call's, or under a policy that owns the cache the span
  the caller reports (`StepOutput.queries`)."""
  return queries if result.outputs.queries is None else result.outputs.queries


def decode(family, run, params, consts, carry, istate, i, phase: driver.Phase, call: Call) -> tuple[Any, Any, Any]:
  """One step with the model call `call` (module docstring): "full" (no cache), "refresh" (the whole
  sequence, filling the cache), "prefix" or "dual" — in the one-phase layout "dual" means the refresh at a
  block's first step (a `lax.cond`) and the dual call after. Returns (carry, istate, StepOutput)."""
  o, mask_id, lp = family.options, family.mask_id, run.prompt_length
  k = _block_index(carry, phase)
  s = lp + k * o.block
  x = carry.tokens
  block_tokens = _rows(x, s, o.block)
  candidates = _candidates(family, run, x, carry.decode_step, s)
  active = jnp.any(candidates, axis=1)
  block_step = jnp.zeros((), jnp.int32) if call == "refresh" else carry.block_step
  fresh = block_step == 0
  schedule = jnp.where(fresh, llada_transfer_counts(jnp.sum(candidates, axis=1), o.steps_per_block),
                       carry.schedule)
  key, step_key = keys.split(carry.key, 2, run.row_keys)
  if blocks.policy_owns_cache(run):  # the policy emulates the cache (`blocks.CACHE_POLICIES`): whole-sequence calls
    call = "full"
  if _capped(o):
    return _capped_dual_step(family, run, params, consts, carry, istate, i, s, schedule, block_step, fresh, key,
                             step_key)
  if run.row_keys:
    key = keys.keep_rows(active, key, carry.key)
  if call == "dual" and phase.arg is None:
    result, queries = jax.lax.cond(
        fresh, lambda: _model_call(family, run, params, consts, carry, istate, i, s, "refresh", step_key,
                                    block_step),
        lambda: _model_call(family, run, params, consts, carry, istate, i, s, "dual", step_key, block_step))
  else:
    result, queries = _model_call(family, run, params, consts, carry, istate, i, s, call, step_key, block_step)
  x0, confidence = family._proposals(params, result.logits, result.uncond_logits, step_key, run.row_keys)
  chosen = _transfer(family, confidence, candidates, schedule, block_step)
  new_x = jax.lax.dynamic_update_slice_in_dim(x, jnp.where(chosen, x0, block_tokens), s, axis=1)
  decode_step = update_decode_step(carry.decode_step, x[:, lp:], new_x[:, lp:], mask_id, i)
  block_step = block_step + 1
  block = carry.block
  if phase.arg is None:
    block_over = ~jnp.any(_rows(decodable(family, run, new_x, decode_step), s, o.block)) | (block_step >= _bound(o))
    block = block + block_over.astype(jnp.int32)
    block_step = jnp.where(block_over, 0, block_step)
  carry = carry.replace(tokens=new_x, key=key, schedule=schedule, decode_step=decode_step, block_step=block_step,
                        block=block, cache=result.cache if result.cache is not None else carry.cache)
  outputs = result.outputs.replace(active=active, queries=_queries(result, queries))
  return carry, result.state, outputs


def _capped_dual_step(family, run, params, consts, carry, istate, i, s, schedule, block_step, fresh, key, step_key):
  """A step of the dual cache under NVlabs' current per-block cap (`LLaDAOptions.dual_cache_forwards`): the
  refresh proposes at every position and its candidates are all masks before the block's end (masks an
  earlier block left included); a cached call's candidates are the block's masks. Proposals, confidences
  and candidates are sequence-wide [B, S]. Returns (carry, istate, StepOutput)."""
  o, mask_id, lp, x = family.options, family.mask_id, run.prompt_length, carry.tokens
  position = jnp.arange(run.total_length)[None, :]
  masked = x == mask_id

  def propose(call: Call):
    result, queries = _model_call(family, run, params, consts, carry, istate, i, s, call, step_key, block_step)
    x0, confidence = family._proposals(params, result.logits, None, step_key, run.row_keys)
    if call == "refresh":
      candidates = masked & (position < s + o.block)
    else:
      candidates = masked & (position >= s) & (position < s + o.block)
      x0 = jax.lax.dynamic_update_slice_in_dim(x, x0, s, axis=1)
      confidence = jax.lax.dynamic_update_slice_in_dim(jnp.full(x.shape, -jnp.inf, confidence.dtype), confidence,
                                                       s, axis=1)
    return x0, confidence, candidates, result.replace(logits=None, uncond_logits=None), queries

  x0, confidence, candidates, result, queries = jax.lax.cond(fresh, lambda: propose("refresh"),
                                                             lambda: propose("dual"))
  active = jnp.any(candidates, axis=1)
  if run.row_keys:
    key = keys.keep_rows(active, key, carry.key)
  chosen = _transfer(family, confidence, candidates, schedule, block_step)
  new_x = jnp.where(chosen, x0, x)
  decode_step = update_decode_step(carry.decode_step, x[:, lp:], new_x[:, lp:], mask_id, i)
  block_step = block_step + 1
  block_over = ~jnp.any(_rows(new_x, s, o.block) == mask_id) | (block_step >= _bound(o))
  carry = carry.replace(tokens=new_x, key=key, schedule=schedule, decode_step=decode_step,
                        block_step=jnp.where(block_over, 0, block_step),
                        block=carry.block + block_over.astype(jnp.int32), cache=result.cache)
  outputs = result.outputs.replace(active=active, queries=_queries(result, queries))
  return carry, result.state, outputs
