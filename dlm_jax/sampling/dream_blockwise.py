"""The Dream family's block-by-block modes (`reference/decoding_modes.md` §7, with §2, §4, §5): Fast-dLLM's
Dream decoding — confidence-threshold (or factor) parallel decoding, or a per-block timestep quota — with
no cache, the prefix KV cache or the dual KV cache.

`DreamOptions.block_length` turns these modes on. The G generated positions are split into G / B blocks
[s, e) = [Lp + kB, Lp + (k + 1)B) (right after the padded prompt), decoded left to right. Dream's
prediction for position p is the model output at p − 1 (the logit shift), and s ≥ Lp ≥ 1, so the output at
s − 1 always exists.

Phases. Without a cache and with the dual cache every call has fixed shapes (the whole sequence with a traced
logits offset, or the block's B queries at a traced cache offset), so the run is one driver phase of
num_blocks × bound steps (bound: B calls per block with a threshold or factor, steps / num_blocks with the
quota) with the current block in the carry: a step is the next block's block-start step (a `lax.cond`)
once the current block is done, and `finished` skips the steps after the last block. The run compiles one
block-start call and one block call whatever the number of blocks (first call, tiny Dream, 8 prompt tokens,
blocks of 8, threshold 0.9, best of 3 on a loaded 2-core Xeon: no cache 3.6 s and 3.9 s for 2 and 8
blocks, against 4.0 s and 7.7 s with one phase per block; dual cache 6.5 s and 5.3 s, against 5.9 s and
11.4 s). The prefix cache computes S − s queries, a count that changes with the block, so each of its
blocks is a phase of its own, opened by the block-start step (compile time grows with the number of
blocks).

Block k:
  1. Block-start step: one model call on the whole sequence; position s takes its proposal
     (`dream.sample_tokens` on the output at s − 1) unconditionally — no threshold, no quota — so this
     step commits exactly one token, as Fast-dLLM's refresh does. With a cache this call is the refresh:
     it keeps every layer's keys and values of all S positions.
  2. Then steps until the block holds no mask in (s, e), at most B − 1 with a threshold or factor (each
     step commits at least one token) or exactly steps / num_blocks − 1 with the quota (none when B = 1).
     Each step computes the proposals for (s, e) from the outputs of [s, e − 1) and transfers by the rule
     below:
       * cache "none":   the whole sequence (exact attention);
       * cache "prefix": queries [s, S) — the block and every later position — attending to the refresh's
                         cached keys and values of [0, s) and to their own fresh ones;
       * cache "dual":   queries [s, e), their fresh keys and values written into the cache in place,
                         attending to all S cached positions (prefix and later blocks as of the refresh).
     Position s is not a candidate after the block-start step: its prediction needs the output at s − 1,
     which the cached calls do not compute. (Fast-dLLM's cached calls shift the logits inside their
     window, so their first position reads its own output — a wrong shift, unused because that position
     was committed by the refresh. We compute no prediction there, so every prediction we use is
     correctly shifted.) If the block-start proposal was the mask id itself, position s stays a mask,
     as the reference writes proposals unconditionally.

Transfer rules (candidates: the masks of (s, e); confidence from `dream.sample_tokens` in float32, after
temperature, top-p and top-k):
  * `threshold` (Fast-dLLM's alg='confidence_threshold'): the most confident candidate and every candidate
    with p(x0) >= τ (`dlm_jax.sampling.parallel.threshold_transfer`);
  * `factor`: Fast-dLLM's factor rule on p(x0) (`parallel.factor_transfer`; not in Fast-dLLM's Dream code);
  * neither: Fast-dLLM's per-block quota. With T = steps / num_blocks and t = torch.linspace(1, eps, T + 1),
    the block's step j = 1 … T − 1 transfers k = int(n · (1 − t_{j+1}/t_j)) (all n at j = T − 1) of the row's
    n candidates, the most confident by `alg`'s confidence (p(x0), top1 − top2, or negative entropy), or
    k drawn without replacement from softmax(confidence / alg_temp) when alg_temp > 0. Fast-dLLM ranks by
    negative entropy whatever `alg` says (alg='entropy' is its behaviour) and takes n as the batch mean;
    we take each row's own n (equal in a lockstep batch unless a proposal is the mask id itself).

The block's completion is tested before each call (a block the block-start step already finished, B = 1,
gets no further call; Fast-dLLM tests after its cached calls and makes one more). A block still holding
masks after its bound (only when proposals are the mask id itself) keeps them. In a batch the rows move to
the next block together: a row whose block is done waits (unchanged, `Trace.active_rows` False, its key
and its intervention state not advanced — `Intervention.keep_rows`) while the others finish, so its
tokens and `row_nfe` are those it gets alone.

Under a compute policy that composes with a cache (`blocks.CACHE_POLICIES`, Sparse-dLLM) every call hands the
model the whole sequence (the "none" layout above) and the policy's decisions make the cache's calls, reading
the policy's KV cache (`dlm_jax.policy.policies.SparseDLLM`).

Caches hold keys and values after RoPE at the rows' (shifted) positions (Fast-dLLM stores them before
RoPE and rotates on every call; the results are equal). Masks inside the prompt are never candidates.
Random draws (temperature > 0, alg_temp > 0) cover the positions whose logits a call computes — s at the
block start, (s, e) after — so their shapes do not depend on the batch's prompt width.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from dlm_jax.sampling import blocks, driver, keys, padding
from dlm_jax.sampling.call_inputs import CacheCall, CallInputs, Readout
from dlm_jax.sampling.parallel import factor_transfer, threshold_transfer
from dlm_jax.sampling.schedules import dream_transfer_count, dream_transfer_fractions
from dlm_jax.sampling.selection import select_top_k, update_decode_step


def _bound(options) -> int:
  """The most calls of a block, its block-start step included: B (threshold, factor) or steps / num_blocks
  (quota); 1 when B = 1 (the block-start step decodes the block's one position)."""
  parallel = options.threshold is not None or options.factor is not None
  return options.block if parallel or options.block == 1 else options.steps_per_block


def phases(options) -> tuple[driver.Phase, ...]:
  """`blocks.phases` with this family's per-block bound."""
  return blocks.phases(options.cache, options.num_blocks, _bound(options))


init_cache = blocks.init_cache


def _block_start(run, options, block):
  """s = Lp + kB; block: int or traced scalar."""
  return run.prompt_length + block * options.block


def _rows(array: jax.Array, start, length: int) -> jax.Array:
  """array[:, start:start + length] of a [B, S] array; start: int or traced scalar."""
  return jax.lax.dynamic_slice_in_dim(array, start, length, axis=1)


def _done(family, run, carry, block) -> jax.Array:
  """Scalar bool: `block` (int or traced) has had its block-start step and no row holds a mask in (s, e),
  or it has made its bound of calls."""
  o = family.options
  inner = _rows(carry.tokens, _block_start(run, o, block) + 1, o.block - 1)
  return (carry.block == block) & (~jnp.any(inner == family.mask_id) | (carry.block_step >= _bound(o)))


def finished(family, run, carry, phase: driver.Phase) -> jax.Array:
  """Skip the call: block `phase.arg` is done (per-block phases), or the last block is (one phase)."""
  if phase.arg is not None:
    return _done(family, run, carry, phase.arg)
  return (carry.block == family.options.num_blocks - 1) & _done(family, run, carry, carry.block)


def _model_call(family, run, params, consts: padding.PaddingLayout, carry, istate, i, start, length: int,
                window: tuple[int, int], logits_offset, block):
  """The model on sequence positions [start, start + length) (a cached call when the options have a cache;
  start: int or traced), logits of the call's positions window = [w0, w1) moved by logits_offset (int or
  traced); block: (first position, calls before this one) of the current block. Returns the `CallResult`."""
  x, cached = carry.tokens, family.options.cache != "none" and not blocks.policy_owns_cache(run)
  inputs = CallInputs(_rows(x, start, length), _rows(consts.positions, start, length),
                      _rows(consts.valid, start, length), consts.valid,
                      padding.query_rows(consts.bias, start, length), block_start=block[0], block_step=block[1])
  return run.caller(params, i, istate, inputs, Readout(window=window, offset=logits_offset),
                    CacheCall(carry.cache, start, x) if cached else None)


def open_block(family, run, params, consts: padding.PaddingLayout, carry, istate, i, block):
  """The block-start step of `block` (int or traced; module docstring, 1). Returns (carry, istate,
  StepOutput)."""
  o, lp, total = family.options, run.prompt_length, run.total_length
  s = _block_start(run, o, block)
  x = carry.tokens
  key, sample_key = keys.split(carry.key, 2, run.row_keys)
  result = _model_call(family, run, params, consts, carry, istate, i, 0, total, (lp - 1, lp), s - lp, (s, 0))
  _, x0 = family.proposals(run, result.logits, sample_key)
  new_x = jax.lax.dynamic_update_slice_in_dim(x, x0, s, axis=1)
  decode_step = update_decode_step(carry.decode_step, x[:, lp:], new_x[:, lp:], family.mask_id, i)
  carry = carry.replace(tokens=new_x, key=key, decode_step=decode_step, block=jnp.asarray(block, jnp.int32),
                        block_step=jnp.int32(1), cache=carry.cache if result.cache is None else result.cache)
  outputs = result.outputs.replace(active=jnp.ones(x.shape[:1], bool), queries=jnp.array([0, total], jnp.int32))
  return carry, result.state, outputs


def _quota(family, confidence, candidates, block_step, select_key, per_row: bool) -> jax.Array:
  """The per-block timestep quota (module docstring): [B, W] confidence and candidates -> [B, W] bool."""
  o = family.options
  fractions = jnp.asarray(dream_transfer_fractions(o.steps_per_block, o.eps))
  count = dream_transfer_count(jnp.sum(candidates, axis=1), 1, fractions[block_step],
                               block_step == o.steps_per_block - 1)
  scores = jnp.where(candidates, confidence, -jnp.inf)
  if o.alg_temp:
    scores = jax.nn.log_softmax(scores / o.alg_temp, axis=-1) + keys.gumbel(select_key, scores.shape, jnp.float32,
                                                                             per_row)
  return select_top_k(scores, count) & candidates


def step(family, run, params, consts: padding.PaddingLayout, carry, istate, i, phase: driver.Phase
         ) -> tuple[Any, Any, Any]:
  """A step after the block-start step of block `phase.arg` (per-block phases) or, in the one-phase layout,
  of the carry's block — or, once that block is done, the next block's block-start step (a `lax.cond`).
  Returns (carry, istate, StepOutput)."""
  if phase.arg is not None:
    return _block_step(family, run, params, consts, carry, istate, i, phase.arg)
  if _bound(family.options) == 1:
    return open_block(family, run, params, consts, carry, istate, i, carry.block + 1)
  opening = (carry.block < 0) | _done(family, run, carry, carry.block)
  block = carry.block + opening.astype(jnp.int32)
  return jax.lax.cond(opening, lambda: open_block(family, run, params, consts, carry, istate, i, block),
                      lambda: _block_step(family, run, params, consts, carry, istate, i, block))


def _block_step(family, run, params, consts: padding.PaddingLayout, carry, istate, i, block
                ) -> tuple[Any, Any, Any]:
  """A step of `block` (int or traced) after its block-start step (module docstring, 2)."""
  o, mask_id, lp, total = family.options, family.mask_id, run.prompt_length, run.total_length
  s = _block_start(run, o, block)
  x = carry.tokens
  inner = _rows(x, s + 1, o.block - 1)
  candidates = inner == mask_id
  active = jnp.any(candidates, axis=1)
  key, sample_key, select_key = keys.split(carry.key, 3, run.row_keys)
  if run.row_keys:
    key = keys.keep_rows(active, key, carry.key)
  if o.cache == "none" or blocks.policy_owns_cache(run):
    start, length, window, offset = 0, total, (lp, lp + o.block - 1), s - lp
  elif o.cache == "prefix":
    start, length, window, offset = s, total - s, (0, o.block - 1), 0
  else:
    start, length, window, offset = s, o.block, (0, o.block - 1), 0
  result = _model_call(family, run, params, consts, carry, istate, i, start, length, window, offset,
                       (s, carry.block_step))
  if o.threshold is not None or o.factor is not None:
    confidence, x0 = family.proposals(run, result.logits, sample_key)
    if o.factor is not None:
      chosen = factor_transfer(confidence, candidates, o.factor, o.factor_rule)
    else:
      chosen = threshold_transfer(confidence, candidates, o.threshold)
  else:
    confidence, x0 = family.proposals(run, result.logits, sample_key, o.alg)
    chosen = _quota(family, confidence, candidates, carry.block_step, select_key, run.row_keys)
  new_x = jax.lax.dynamic_update_slice_in_dim(x, jnp.where(chosen, x0, inner), s + 1, axis=1)
  decode_step = update_decode_step(carry.decode_step, x[:, lp:], new_x[:, lp:], mask_id, i)
  cache = carry.cache if result.cache is None else result.cache
  carry = carry.replace(tokens=new_x, key=key, decode_step=decode_step, block_step=carry.block_step + 1, cache=cache)
  queries = jnp.stack([jnp.asarray(start, jnp.int32), jnp.asarray(start + length, jnp.int32)])
  outputs = result.outputs.replace(active=active, queries=queries if result.outputs.queries is None
                                   else result.outputs.queries)  # a policy's calls: the span it computed
  return carry, result.state, outputs
