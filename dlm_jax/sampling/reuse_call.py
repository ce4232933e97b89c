"""A model call under a reuse decision (`dlm_jax.policy.base.ReuseSchedule`, dLLM-Cache): one `lax.switch`
over the four static cases (prompt recomputed or not × response recomputed or not, at the layers after the
first), each a forward with `ComputeSubset(reuse=LayerReuse(...))` (`dlm_jax.model.reuse_layers`) over the whole
sequence. Only the case taken runs; each case's program computes only its own rows. The case with both
regions recomputed is the refresh: every layer recomputes every position and rewrites every cache.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from dlm_jax.instrument.stats import ForwardOutput
from dlm_jax.model.compute_subset import ComputeSubset
from dlm_jax.model.reuse_layers import LayerReuse, ReuseCache
from dlm_jax.policy.base import ReuseSchedule
from dlm_jax.model.forward_inputs import CallInstruments, Readout

CASES = ((False, False), (False, True), (True, False), (True, True))
"""(prompt recomputed, response recomputed) of each `lax.switch` branch, in index order 2·prompt + gen."""


def reuse_forward(run: Callable[..., ForwardOutput], cache: ReuseCache, schedule: ReuseSchedule,
                  tokens: jax.Array, positions: jax.Array, instruments: CallInstruments,
                  readout: Readout) -> ForwardOutput:
  """The call's `ForwardOutput` (logits or hidden states of the readout window — every position is computed —,
  statistics over the recomputed queries of each layer, the new `ReuseCache`). run: the forward with params,
  config and the attention path bound (`policy_call.policy_forward`); tokens, positions: [B, S]; instruments: the
  call's `CallInstruments` over the S positions (bias, statistics spec, query-group weights [B, Q, S] or None,
  the `HookCall` with flags [B, S] or None)."""
  queries = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32)[None], tokens.shape)

  def branch(case):
    prompt, gen = case

    def call(_):
      reuse = LayerReuse(attn=cache.attn, ffn=cache.ffn, prompt_length=schedule.prompt_length,
                         count=schedule.count, refresh_prompt=prompt, refresh_gen=gen,
                         first_layer_full=schedule.first_layer_full)
      return run(tokens, positions=positions, instruments=instruments, readout=readout, cache=cache.kv,
                 subset=ComputeSubset(queries, reuse=reuse))

    return call

  index = 2 * jnp.asarray(schedule.prompt, jnp.int32) + jnp.asarray(schedule.gen, jnp.int32)
  return jax.lax.switch(index, [branch(case) for case in CASES], None)
