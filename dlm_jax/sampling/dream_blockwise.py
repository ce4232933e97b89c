"""The Dream family's block-by-block modes (`reference/decoding_modes.md` §7, with §2, §4, §5): Fast-dLLM's
Dream decoding — confidence-threshold (or factor) parallel decoding, or a per-block timestep quota — with
no cache, the prefix KV cache or the dual KV cache.

`DreamOptions.block_length` turns these modes on. The G generated positions are split into G / B blocks
[s, e) = [Lp + kB, Lp + (k + 1)B) (right after the padded prompt), decoded left to right; each block is a
static driver `Phase` whose opening is the block-start step. Dream's prediction for position p is the
model output at p − 1 (the logit shift), and s ≥ Lp ≥ 1, so the output at s − 1 always exists.

Block k:
  1. Block-start step (the phase's opening): one model call on the whole canvas; position s takes its
     proposal (`dream.sample_tokens` on the output at s − 1) unconditionally — no threshold, no quota —
     so this step commits exactly one token, as Fast-dLLM's refresh does. With a cache this call is the
     refresh: it keeps every layer's keys and values of all S positions.
  2. Then steps until the block holds no mask in (s, e), at most B − 1 with a threshold or factor (each
     step commits at least one token) or exactly steps / num_blocks − 1 with the quota. Each step computes
     the proposals for (s, e) from the outputs of [s, e − 1) and transfers by the rule below:
       * cache "none":   the whole canvas (exact attention);
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

Caches hold keys and values after RoPE at the rows' (shifted) positions (Fast-dLLM stores them before
RoPE and rotates on every call; the results are equal). Masks inside the prompt are never candidates.
Random draws (temperature > 0, alg_temp > 0) cover the positions whose logits a call computes — s at the
block start, (s, e) after — so their shapes do not depend on the batch's prompt width.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from dlm_jax.model import KVCache
from dlm_jax.sampling import driver, keys, padding
from dlm_jax.sampling.parallel import factor_transfer, threshold_transfer
from dlm_jax.sampling.schedules import dream_transfer_count, dream_transfer_fractions
from dlm_jax.sampling.selection import select_top_k, update_decode_step


def phases(options) -> tuple[driver.Phase, ...]:
  """One phase per block: the block-start step as its opening, then up to B − 1 (threshold, factor) or
  steps / num_blocks − 1 (quota) steps."""
  parallel = options.threshold is not None or options.factor is not None
  bound = options.block - 1 if parallel else options.steps_per_block - 1
  return tuple(driver.Phase(arg=k, steps=bound, opening=True) for k in range(options.num_blocks))


def init_cache(run, params, batch: int) -> KVCache | None:
  """The run's `KVCache` ([L, B, S, K, H], the parameters' dtype), or None without a cache."""
  if run.family.options.cache == "none":
    return None
  return KVCache.zeros(run.config, batch, run.total_length, params["embed"]["embedding"].dtype)


def _block_start(run, options, block: int) -> int:
  return run.prompt_length + block * options.block


def finished(family, run, carry, phase: driver.Phase) -> jax.Array:
  """Block `phase.arg` has had its block-start step and no row holds a mask in (s, e). Scalar bool."""
  o = family.options
  s = _block_start(run, o, phase.arg)
  opened = carry.block == phase.arg
  return opened & ~jnp.any(carry.tokens[:, s + 1:s + o.block] == family.mask_id)


def _model_call(family, run, params, consts: padding.PaddingLayout, carry, istate, i, start: int, stop: int,
                window: tuple[int, int]):
  """The model on canvas positions [start, stop) (a cached call when the options have a cache), logits of
  the canvas positions window = [w0, w1). Returns the `CallResult`."""
  x, cached = carry.tokens, family.options.cache != "none"
  return run.caller(params, x[:, start:stop], i, istate, window=(window[0] - start, window[1] - start),
                    positions=consts.positions[:, start:stop], valid_keys=consts.valid,
                    query_valid=consts.valid[:, start:stop],
                    base_bias=padding.query_rows(consts.bias, start, stop - start),
                    cache=carry.cache if cached else None, cache_offset=start, canvas=x if cached else None)


def open_block(family, run, params, consts: padding.PaddingLayout, carry, istate, i, phase: driver.Phase):
  """Block `phase.arg`'s block-start step (module docstring, 1). Returns (carry, istate, StepOutput)."""
  o, lp, total = family.options, run.prompt_length, run.total_length
  s = _block_start(run, o, phase.arg)
  x = carry.tokens
  key, sample_key = keys.split(carry.key, 2, run.row_keys)
  result = _model_call(family, run, params, consts, carry, istate, i, 0, total, (s - 1, s))
  _, x0 = family.proposals(run, result.logits, sample_key)
  new_x = x.at[:, s].set(x0[:, 0])
  decode_step = update_decode_step(carry.decode_step, x[:, lp:], new_x[:, lp:], family.mask_id, i)
  carry = carry.replace(tokens=new_x, key=key, decode_step=decode_step, block=jnp.int32(phase.arg),
                        block_step=jnp.int32(1), cache=carry.cache if result.cache is None else result.cache)
  return carry, result.intervention_state, result.outputs.replace(queries=jnp.array([0, total], jnp.int32))


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
  """A step of block `phase.arg` after its block-start step (module docstring, 2). Returns (carry, istate,
  StepOutput)."""
  o, mask_id, lp, total = family.options, family.mask_id, run.prompt_length, run.total_length
  s = _block_start(run, o, phase.arg)
  e = s + o.block
  x = carry.tokens
  candidates = x[:, s + 1:e] == mask_id
  active = jnp.any(candidates, axis=1)
  key, sample_key, select_key = keys.split(carry.key, 3, run.row_keys)
  if run.row_keys:
    key = keys.keep_rows(active, key, carry.key)
  start, stop = {"none": (0, total), "prefix": (s, total), "dual": (s, e)}[o.cache]
  result = _model_call(family, run, params, consts, carry, istate, i, start, stop, (s, e - 1))
  if o.threshold is not None or o.factor is not None:
    confidence, x0 = family.proposals(run, result.logits, sample_key)
    if o.factor is not None:
      chosen = factor_transfer(confidence, candidates, o.factor)
    else:
      chosen = threshold_transfer(confidence, candidates, o.threshold)
  else:
    confidence, x0 = family.proposals(run, result.logits, sample_key, o.alg)
    chosen = _quota(family, confidence, candidates, carry.block_step, select_key, run.row_keys)
  new_x = x.at[:, s + 1:e].set(jnp.where(chosen, x0, x[:, s + 1:e]))
  decode_step = update_decode_step(carry.decode_step, x[:, lp:], new_x[:, lp:], mask_id, i)
  cache = carry.cache if result.cache is None else result.cache
  carry = carry.replace(tokens=new_x, key=key, decode_step=decode_step, block_step=carry.block_step + 1, cache=cache)
  outputs = result.outputs.replace(active=active, queries=jnp.array([start, stop], jnp.int32))
  return carry, run.caller.intervention.keep_rows(result.intervention_state, istate, active), outputs
