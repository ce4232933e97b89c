"""The LLaDA / MMaDA family's block-by-block modes (`reference/decoding_modes.md` §2–§5): Fast-dLLM
confidence-threshold and factor parallel decoding, and the prefix and dual KV caches, in any combination.

`LLaDAOptions.threshold` / `factor` choose the transfer rule (`dlm_jax.sampling.parallel`; neither = the
per-step quota of the exact sampler) and `LLaDAOptions.cache` the model calls. The blocks are the same as
the exact sampler's ([Lp + kB, Lp + (k + 1)B), after the prompt); each block is a static driver `Phase`
and at each step the candidates are the masked positions of the current block only.

Model calls in block k = [s, e):
  * "none":   every step runs the whole canvas (exact attention); the logits are the block's.
  * "prefix": the block's first step runs the whole canvas and keeps every layer's keys and values (the
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
(unchanged, `Trace.active_rows` False, its key not advanced) while the others finish, so its tokens and
`row_nfe` are those it gets alone (an intervention's state, e.g. the previous step's sinks, still updates
on its unchanged canvas while it waits).

Not supported (a clear error): classifier-free guidance with a cache (the unconditional canvas would need
a cache of its own; Fast-dLLM has no CFG).
"""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp

from dlm_jax.model import KVCache
from dlm_jax.sampling import driver, keys, padding
from dlm_jax.sampling.parallel import factor_transfer, threshold_transfer
from dlm_jax.sampling.schedules import llada_transfer_counts
from dlm_jax.sampling.selection import select_top_k, update_decode_step

Call = Literal["full", "refresh", "prefix", "dual"]


def phases(options) -> tuple[driver.Phase, ...]:
  """One phase per block: an opening refresh with a cache, then steps up to the block's bound."""
  cached = options.cache != "none"
  bound = options.steps_per_block if options.threshold is None and options.factor is None else options.block
  return tuple(driver.Phase(arg=k, steps=bound - int(cached), opening=cached) for k in range(options.num_blocks))


def init_cache(run, params, batch: int) -> KVCache | None:
  if run.family.options.cache == "none":
    return None
  return KVCache.zeros(run.config, batch, run.total_length, params["embed"]["embedding"].dtype)


def finished(family, run, carry, phase: driver.Phase) -> jax.Array:
  """Every row's block `phase.arg` holds no mask, or (MMaDA's stop id) every row's previous position holds
  the stop id."""
  o = family.options
  s = run.prompt_length + phase.arg * o.block
  done = ~jnp.any(carry.tokens[:, s:s + o.block] == family.mask_id)
  if o.stop_token_id is not None and phase.arg > 0:
    done = done | jnp.all(carry.tokens[:, s - 1] == o.stop_token_id)
  return done


def _transfer(options, confidence, candidates, schedule, block_step):
  if options.factor is not None:
    return factor_transfer(confidence, candidates, options.factor)
  if options.threshold is not None:
    return threshold_transfer(confidence, candidates, options.threshold)
  count = jax.lax.dynamic_index_in_dim(schedule, block_step, axis=1, keepdims=False)
  return select_top_k(jnp.where(candidates, confidence, -jnp.inf), count) & candidates


def decode(family, run, params, consts, carry, istate, i, phase: driver.Phase, call: Call) -> tuple[Any, Any, Any]:
  """One step of block `phase.arg` with the model call `call` (module docstring): "full" (no cache),
  "refresh" (the whole canvas, filling the cache), "prefix" or "dual". Returns (carry, istate, StepOutput)."""
  o, mask_id, lp, total = family.options, family.mask_id, run.prompt_length, run.total_length
  s = lp + phase.arg * o.block
  e = s + o.block
  x = carry.tokens
  candidates = x[:, s:e] == mask_id
  active = jnp.any(candidates, axis=1)
  schedule, block_step = carry.schedule, carry.block_step
  if call == "refresh":
    schedule = llada_transfer_counts(jnp.sum(candidates, axis=1), o.steps_per_block)
    block_step = jnp.zeros((), jnp.int32)
  start, stop = {"full": (0, total), "refresh": (0, total), "prefix": (s, total), "dual": (s, e)}[call]
  layout = consts.layout
  key, step_key = keys.split(carry.key, 2, run.row_keys)
  if run.row_keys:
    key = keys.keep_rows(active, key, carry.key)
  uncond = jnp.where(consts.prompt_index, mask_id, x) if o.cfg_scale > 0 else None
  cache = None if call == "full" else carry.cache
  result = run.caller(params, x[:, start:stop], i, istate, window=(s - start, e - start),
                      positions=layout.positions[:, start:stop], valid_keys=layout.valid,
                      query_valid=layout.valid[:, start:stop], base_bias=padding.query_rows(layout.bias, start,
                                                                                            stop - start),
                      uncond_tokens=uncond, uncond_base_bias=consts.uncond_bias, cache=cache, cache_offset=start,
                      canvas=None if cache is None else x)
  x0, confidence = family._proposals(params, result.logits, result.uncond_logits, step_key, run.row_keys)
  chosen = _transfer(o, confidence, candidates, schedule, block_step)
  new_x = x.at[:, s:e].set(jnp.where(chosen, x0, x[:, s:e]))
  decode_step = update_decode_step(carry.decode_step, x[:, lp:], new_x[:, lp:], mask_id, i)
  carry = carry.replace(tokens=new_x, key=key, schedule=schedule, decode_step=decode_step,
                        block_step=block_step + 1, cache=result.cache if cache is not None else carry.cache)
  outputs = result.outputs.replace(active=active, queries=jnp.array([start, stop], jnp.int32))
  return carry, result.intervention_state, outputs
