"""The published methods that run as compute policies: each is its settings dataclass (published defaults,
official-code quirks as knobs; `dlm_jax.policy.<method>`) and the protocol of `dlm_jax.policy.base`, its
decisions made by the method's rule functions.

Runnable here: `dkv_cache` (queries: the positions masked at the previous call; full at a block's first two
steps and every `cache_reloading_step`), `sparse_dllm` (at a block's steps >= 2 the block's queries only, each
layer reading the keys kept at step 1 by the block-mean query score), `d2cache` (`dlm_jax.policy.d2cache_policy`:
the positions its rollout and certainty rule selected, at the smallest query bucket that holds them). The rules
of `dllm_cache`, `elastic_cache` and `sparsed` are written and tested (`dlm_jax.policy.<method>`) but their
model-side mechanisms (per-layer reuse of attention and feed-forward outputs, layer-range refresh, block-sparse
attention) are not: they are not selectable yet (`NOT_RUNNABLE`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from dlm_jax.config import ModelConfig
from dlm_jax.instrument.stats import ForwardOutput, StatsSpec
from dlm_jax.policy import dkv_cache, sparse_dllm
from dlm_jax.policy.base import ComputePolicy, Decision
from dlm_jax.policy.d2cache_policy import D2Cache

NOT_RUNNABLE = ("dllm_cache", "elastic_cache", "sparsed")
"""Methods whose rules exist (`dlm_jax.policy.<name>`) but which cannot run as policies yet."""


def _step_in_block(policy: ComputePolicy, context: Any) -> jax.Array:
  return jnp.asarray(context.step, jnp.int32) % policy.layout.steps_per_block


def _block_start(policy: ComputePolicy, context: Any) -> jax.Array:
  """The current block's first sequence position (the sampler's block of this step)."""
  layout = policy.layout
  return layout.gen_start + (jnp.asarray(context.step, jnp.int32) // layout.steps_per_block) * layout.block_length


@dataclasses.dataclass(frozen=True)
class DKVCache(dkv_cache.DKVCacheSettings, ComputePolicy):
  """dKV-Cache (decode variant) as a policy: state [B, S] bool, the positions masked in the previous call's
  input (`dkv_cache.DecodeEvents`)."""

  def check_knobs(self) -> None:
    dkv_cache.DKVCacheSettings.check(self)

  def check(self, config: ModelConfig | None = None, family_name: str | None = None) -> None:
    """The knobs (the settings' check, also run at construction) and, for a run, the family."""
    dkv_cache.DKVCacheSettings.check(self)
    if family_name is not None and family_name not in dkv_cache.FAMILIES:
      raise ValueError(f"policy dkv_cache has its decode rule for the {', '.join(dkv_cache.FAMILIES)} sampler, not "
                       f"{family_name}.")

  def init_state(self, config: ModelConfig, batch: int) -> jax.Array:
    return dkv_cache.start(batch, self.layout.seq_len).was_masked

  def decide(self, state: jax.Array, context: Any) -> Decision:
    full = dkv_cache.is_full_step(_step_in_block(self, context), self)
    index, valid = dkv_cache.query_positions(dkv_cache.DecodeEvents(state), self.layout.gen_start)
    return Decision(full=full, queries=jnp.where(valid, index, self.layout.seq_len).astype(jnp.int32))

  def update(self, state: jax.Array, output: ForwardOutput, context: Any, decision: Decision) -> jax.Array:
    del state, output, decision
    return context.unresolved


@dataclasses.dataclass(frozen=True)
class SparseDLLM(sparse_dllm.SparseDLLMSettings, ComputePolicy):
  """Sparse-dLLM as a policy: state [B, L, n_keep + keep_sinks] int32, each layer's kept keys chosen at step 1
  of the current block from the score of the block's mean query against every key (`query_key_scores`).

  keep_sinks (ours, not the paper's: "sinks in the loop"): also keep, per layer, the keys among the K with the
  most incoming attention at that step (summed over every query, head mean: the attention-sinks papers'
  metric) that the score did not keep and that lie outside the block (0: the official rule).
  """

  keep_sinks: int = 0

  def check_knobs(self) -> None:
    sparse_dllm.SparseDLLMSettings.check(self)
    if isinstance(self.keep_sinks, bool) or not isinstance(self.keep_sinks, int) or self.keep_sinks < 0:
      raise ValueError(f"sparse_dllm keep_sinks must be an integer >= 0, got {self.keep_sinks!r}.")

  def check(self, config: ModelConfig | None = None, family_name: str | None = None) -> None:
    """The knobs (the settings' check, also run at construction) and, for a run, the block layout."""
    self.check_knobs()
    if config is not None and config.logit_shift:
      raise ValueError("policy sparse_dllm does not run on a logit-shifted model (Dream) yet: the block's first "
                       "position is read from the position before the block, which its calls do not compute "
                       "(how the official Dream code gets it is UNVERIFIED).")
    if self.layout is not None and self.keep_sinks > self.layout.seq_len - self.layout.block_length:
      raise ValueError(f"sparse_dllm keep_sinks={self.keep_sinks} is more than the "
                       f"{self.layout.seq_len - self.layout.block_length} keys outside the block.")
    if self.layout is not None and self.layout.block_length >= self.layout.seq_len:
      raise ValueError("policy sparse_dllm keeps keys outside the current block; the block covers the whole "
                       "sequence here.")

  def required_stats(self, config: ModelConfig) -> StatsSpec:
    """Group 0: every query (the sinks' incoming attention, with keep_sinks); group 1: the block's mean."""
    del config
    return StatsSpec(extra=("query_key_scores",), incoming_attention=self.keep_sinks > 0, per_head=False,
                     query_groups=2)

  def _n_keep(self) -> int:
    layout = self.layout
    return sparse_dllm.keep_count(layout.seq_len, layout.block_length, self.keep_ratio)

  def init_state(self, config: ModelConfig, batch: int) -> jax.Array:
    return jnp.full((batch, config.n_layers, self._n_keep() + self.keep_sinks), self.layout.seq_len, jnp.int32)

  def record(self, state: jax.Array) -> jax.Array:
    """[B, L, n_keep + keep_sinks] int32: each layer's kept keys for the current block (S: none)."""
    return state

  def query_weights(self, state: jax.Array, context: Any) -> jax.Array:
    """[B, 2, T]: 1 on every query; 1 / block_length on the current block's queries (their mean), 0 elsewhere."""
    start = _block_start(self, context)
    index = context.query_index
    in_block = (index >= start) & (index < start + self.layout.block_length)
    weights = jnp.stack([jnp.ones(index.shape, jnp.float32), in_block.astype(jnp.float32) / self.layout.block_length])
    return jnp.broadcast_to(weights[None], (context.tokens.shape[0], 2, index.shape[0]))

  def _sinks(self, output: ForwardOutput, kept: jax.Array, start: jax.Array) -> jax.Array:
    """[L, B, keep_sinks] int32: per layer the top keep_sinks keys by incoming attention, S where the score kept
    one already or it lies in the block."""
    s = self.layout.seq_len
    incoming = output.stats["incoming_attention"][:, :, 0, 0]  # [L, B, S]
    sinks = jax.lax.top_k(incoming, self.keep_sinks)[1].astype(jnp.int32)
    in_block = (sinks >= start) & (sinks < start + self.layout.block_length)
    taken = jnp.any(sinks[..., :, None] == kept[..., None, :], axis=-1)
    return jnp.where(in_block | taken, s, sinks)

  def decide(self, state: jax.Array, context: Any) -> Decision:
    start = _block_start(self, context)
    block = start + jnp.arange(self.layout.block_length, dtype=jnp.int32)
    queries = jnp.broadcast_to(block[None, :], (context.tokens.shape[0], self.layout.block_length))
    return Decision(full=sparse_dllm.is_full_step(_step_in_block(self, context)), queries=queries,
                    keys=jnp.swapaxes(state, 0, 1))

  def update(self, state: jax.Array, output: ForwardOutput, context: Any, decision: Decision) -> jax.Array:
    scores = output.stats["query_key_scores"][:, :, 1]  # [L, B, S]
    start = _block_start(self, context)

    def choose():
      kept = jnp.stack([sparse_dllm.keep_positions(layer_scores, start, self.layout.block_length, self)
                        for layer_scores in scores])  # one layer at a time: the torch top-k replay
      if self.keep_sinks:
        kept = jnp.concatenate([kept, self._sinks(output, kept, start)], axis=-1)
      return jnp.swapaxes(kept, 0, 1)

    return jax.lax.cond(sparse_dllm.is_selection_step(_step_in_block(self, context)), choose, lambda: state)


POLICIES: dict[str, type[ComputePolicy]] = {"dkv_cache": DKVCache, "sparse_dllm": SparseDLLM, "d2cache": D2Cache}
"""The runnable policies by name (`dlm_jax.policy.registry`)."""
