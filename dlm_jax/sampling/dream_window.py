"""Elastic-Cache's Dream decoding (`DreamOptions.window`, `eos_truncation`; `dream.elastic_cache_options()`), as read
in the official `_sample` of `dream/model/generation_utils_elastic.py` (with `get_transfer_index_fast`;
VILA-Lab/Elastic-Cache, through its mirror yxu-dev/Elastic-Cache; facts only). No blocks and no block-start step
(unlike Fast-dLLM's Dream modes, `dream_blockwise`); the call count is not `steps` (unused) but what the run needs.
Each call:

  1. candidates: the first `window` still-decodable masks of the generation (every one with window None;
     `sliding_window.first_masks`); masks in the prompt never are;
  2. one model call on the whole sequence (a compute policy decides what it computes); a candidate's logits are
     the output at the position before it (the logit shift; the official reads rows `window − 1`);
  3. proposals and confidences from Dream's `sample_tokens` with the options' temperature, top-p and top-k; the
     confidence is p(x0) whatever `alg` says (the official passes no alg to its decoding), float32;
  4. every candidate with p(x0) >= min(threshold, the largest candidate's) takes its proposal — at least the
     best (`parallel.threshold_transfer`); or Fast-dLLM's factor rule (`factor`; not in the official code);
  5. EOS truncation (`eos_truncation`): after the first call that decodes the EOS id (the config's, or
     `DreamOptions.eos_token_id`; the official passes `tokenizer.eos_token_id`), the masks after the first EOS
     that call decoded are never candidates again (they stay masks in the output; `sliding_window.eos_cut`).

The run ends when no row has a candidate left (NFE = the calls made; at most G). In a batch a row without
candidates waits (unchanged, `Trace.active_rows` False, its key not advanced), so its tokens and `row_nfe` are
those it gets alone. The official loop is batch 1 and drops a decoded position from its masked set whatever it
decoded; here a position whose proposal was the mask id itself stays a candidate (the replay of
tests/test_policy_elastic_cache_dream.py asserts its runs never propose it). A tie for the best confidence below
the threshold takes all tied positions in the official code and the lowest-index one here.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from dlm_jax.config import logit_shift
from dlm_jax.sampling import keys, padding, sliding_window
from dlm_jax.sampling.call_inputs import CallInputs, Readout
from dlm_jax.sampling.parallel import factor_transfer, threshold_transfer
from dlm_jax.sampling.selection import update_decode_step


def candidates(family, run, tokens: jax.Array, decode_step: jax.Array) -> jax.Array:
  """[B, G] bool: the call's candidates (module docstring, 1 and 5) from tokens [B, S] and decode_step [B, G]."""
  o = family.options
  generated = tokens[:, run.prompt_length:]
  decodable = generated == family.mask_id
  if o.eos_truncation:
    decodable = decodable & sliding_window.before_cut(generated, decode_step, family.eos_id)
  return sliding_window.first_masks(decodable, o.window)


def finished(family, run, carry) -> jax.Array:
  """Scalar bool: no row has a candidate left."""
  return ~jnp.any(candidates(family, run, carry.tokens, carry.decode_step))


def step(family, run, params, consts: padding.PaddingLayout, carry, istate, i) -> tuple[Any, Any, Any]:
  """One call (module docstring). Returns (carry, istate, StepOutput)."""
  o, lp, total, shift = family.options, run.prompt_length, run.total_length, run.config.logit_shift
  x = carry.tokens
  chosen_from = candidates(family, run, x, carry.decode_step)
  active = jnp.any(chosen_from, axis=1)
  key, sample_key = keys.split(carry.key, 2, run.row_keys)
  if run.row_keys:
    key = keys.keep_rows(active, key, carry.key)
  inputs = CallInputs(x, consts.positions, consts.valid, consts.valid, consts.bias, block_start=lp, block_step=i)
  result = run.caller(params, i, istate, inputs, Readout(window=logit_shift.output_window(lp, total, shift)))
  confidence, x0 = family.proposals(run, logit_shift.target_logits(result.logits, lp, shift), sample_key)
  if o.factor is not None:
    chosen = factor_transfer(confidence, chosen_from, o.factor, o.factor_rule)
  else:
    chosen = threshold_transfer(confidence, chosen_from, o.threshold)
  generated = x[:, lp:]
  new_generated = jnp.where(chosen, x0, generated)
  decode_step = update_decode_step(carry.decode_step, generated, new_generated, family.mask_id, i)
  carry = carry.replace(tokens=x.at[:, lp:].set(new_generated), key=key, decode_step=decode_step)
  return carry, result.state, result.outputs.replace(active=active)
