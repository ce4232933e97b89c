"""The published methods that run as compute policies: each is its settings dataclass (published defaults,
official-code quirks as knobs; `dlm_jax.policy.<method>`) and the protocol of `dlm_jax.policy.base`, its
decisions made by the method's rule functions.

Each method's policy class: `DKVCache` and `SparseDLLM` here (dKV-Cache: queries the positions masked at the
previous call, at the smallest of its static row buckets holding them, full at a block's first two steps and every
`cache_reloading_step`, on Dream the official Dream rule, `dkv_cache_dream`; Sparse-dLLM: at a block's steps >= 2
the block's queries only — on Dream with the position before the block —, each layer reading the keys kept at step
1 by the block-mean query score; with the Fast-dLLM caches and block diffusion's exact cache, our compositions), and
`D2Cache`, `DLLMCache`, `ElasticCache`, `SparseD` in `dlm_jax.policy.<method>_policy`. "A block's step" is the
sampler's count (`CallContext.block_step`): under threshold or factor decoding and the decoding rules a block
takes a variable number of calls.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dlm_jax.config import ModelConfig
from dlm_jax.instrument.stats import ForwardOutput, StatsSpec
from dlm_jax.model import query_buckets
from dlm_jax.policy import cost, dkv_cache, dkv_cache_dream, sparse_dllm
from dlm_jax.policy.base import ComputePolicy, Decision
from dlm_jax.policy.d2cache_policy import D2Cache
from dlm_jax.policy.dllm_cache_policy import DLLMCache
from dlm_jax.policy.elastic_cache_policy import ElasticCache
from dlm_jax.policy.positions import ascending_positions
from dlm_jax.policy.sparsed_policy import SparseD


_DKV_FAMILIES = ("llada", "dream")
"""The model families dkv_cache has its rules for: LLaDA's decode rule (MMaDA runs LLaDA's sampler), Dream's."""

def _model_family(family_name: str) -> str:
  """The model family of a sampler family's name ("llada" of "llada_blockwise" and "llada_rules")."""
  return family_name.partition("_")[0]


def _step_in_block(policy: ComputePolicy, context: Any) -> jax.Array:
  """The calls the current block has had before this one: the sampler's count (`CallContext.block_step`; a block
  of a threshold or factor mode takes a variable number of calls), or, for a context without block facts (a
  call made outside a block sampler), the step modulo the layout's steps per block."""
  if context.block_step is not None:
    return jnp.asarray(context.block_step, jnp.int32)
  return jnp.asarray(context.step, jnp.int32) % policy.layout.steps_per_block


def _block_start(policy: ComputePolicy, context: Any) -> jax.Array:
  """The current block's first sequence position: the sampler's (`CallContext.block_start`), or, for a context
  without block facts, the block of a fixed steps_per_block calls per block."""
  if context.block_start is not None:
    return jnp.asarray(context.block_start, jnp.int32)
  layout = policy.layout
  return layout.gen_start + (jnp.asarray(context.step, jnp.int32) // layout.steps_per_block) * layout.block_length


@struct.dataclass
class DKVCacheState:
  """was_masked: [B, S] bool, the positions masked in the previous call's input (`dkv_cache.DecodeEvents`; with
  cache_type "prefill" on Dream, in the block's first call's input); rows: [B] int32, the query rows the last call
  ran (its bucket, padding rows included; S at a full call)."""

  was_masked: jax.Array
  rows: jax.Array


@dataclasses.dataclass(frozen=True)
class DKVCache(dkv_cache.DKVCacheSettings, ComputePolicy):
  """dKV-Cache (decode variant) as a policy: state a `DKVCacheState`.

  On a logit-shifted model (Dream) the official Dream rule runs (`dkv_cache_dream`): cache_reloading_step is its
  cache_steps (the README's Dream value is 16), cache_type "decoded" or "prefill", shift_type "un" (the README's),
  "un_right" or "right"; those two knobs apply to Dream only.

  query_buckets (ours: static shapes): how many static row counts a cached call may run at — its budget
  S − gen_start + logit_shift (every generated position; on Dream also the last prompt position) and its successive
  halves (`buckets`); the call runs at the smallest holding the batch's largest count of positions to compute (in
  the batch-invariant mode each row's own), so its compute follows the count. 1 runs every cached call at the whole
  budget.
  """

  cache_type: str = "decoded"
  shift_type: str = "un"
  query_buckets: int = 4

  def check_knobs(self) -> None:
    dkv_cache.DKVCacheSettings.check(self)
    if self.cache_type not in dkv_cache_dream.CACHE_TYPES:
      raise ValueError(f"dkv_cache cache_type must be one of {', '.join(dkv_cache_dream.CACHE_TYPES)}, got "
                       f"{self.cache_type!r}.")
    if self.shift_type not in dkv_cache_dream.SHIFT_TYPES:
      raise ValueError(f"dkv_cache shift_type must be one of {', '.join(dkv_cache_dream.SHIFT_TYPES)}, got "
                       f"{self.shift_type!r}.")
    if isinstance(self.query_buckets, bool) or not isinstance(self.query_buckets, int) or self.query_buckets < 1:
      raise ValueError(f"dkv_cache query_buckets must be an int >= 1, got {self.query_buckets!r}.")

  def check(self, config: ModelConfig | None = None, family_name: str | None = None) -> None:
    """The knobs (the settings' check, also run at construction) and, for a run, the family."""
    self.check_knobs()
    if family_name is not None and _model_family(family_name) not in _DKV_FAMILIES:
      raise ValueError(f"policy dkv_cache has its decode rule for the {', '.join(_DKV_FAMILIES)} samplers, not "
                       f"{family_name}.")
    dream_knobs = (self.cache_type, self.shift_type) != ("decoded", "un")
    if config is not None and not config.logit_shift and dream_knobs:
      raise ValueError("dkv_cache cache_type and shift_type are the rules of Dream's code (a logit-shifted model); "
                       "leave them at decoded and un here.")

  @property
  def buckets(self) -> tuple[int, ...]:
    """The static query-row counts a cached call runs at: the budget S − gen_start + logit_shift and its halves
    (rounded up), ascending. Needs the bound policy (`bind`)."""
    largest = self.layout.seq_len - self.layout.gen_start + self.layout.logit_shift
    return query_buckets.halvings(largest, self.query_buckets)

  def init_state(self, config: ModelConfig, batch: int) -> DKVCacheState:
    s = self.layout.seq_len
    return DKVCacheState(was_masked=dkv_cache.start(batch, s).was_masked, rows=jnp.full((batch,), s, jnp.int32))

  def record(self, state: DKVCacheState) -> dict[str, jax.Array]:
    """{"rows": [B] int32}: the query rows the call ran — its bucket, padding rows included (the compute; S at a
    full call)."""
    return {"rows": state.rows}

  def decide(self, state: DKVCacheState, context: Any) -> Decision:
    if self.layout.logit_shift:
      return self._decide_shifted(state.was_masked, context)
    full = dkv_cache.is_full_step(_step_in_block(self, context), self)
    index, valid = dkv_cache.query_positions(dkv_cache.DecodeEvents(state.was_masked), self.layout.gen_start)
    return Decision(full=full, queries=jnp.where(valid, index, self.layout.seq_len).astype(jnp.int32),
                    buckets=self.buckets)

  def _decide_shifted(self, was_masked: jax.Array, context: Any) -> Decision:
    """Dream's rule (`dkv_cache_dream`): the positions not cached, among [gen_start - 1, S) (a cached call never
    computes an earlier one: the prompt's positions but its last are cached from call 1 on)."""
    call = _step_in_block(self, context)
    first = (call == 1) | (self.cache_type == "prefill")
    cached = dkv_cache_dream.cached_positions(~was_masked, self.shift_type, first)
    start = self.layout.gen_start - 1
    index, valid = ascending_positions(~cached[:, start:], self.layout.seq_len - start)
    return Decision(full=dkv_cache_dream.is_full_call(call, self.cache_type, self.cache_reloading_step),
                    queries=jnp.where(valid, index + start, self.layout.seq_len).astype(jnp.int32),
                    buckets=self.buckets)

  def call_flops(self, config: ModelConfig, computed: np.ndarray, keys: float, record: dict) -> float:
    """Trunk FLOPs of one row's call (`ComputePolicy.call_flops`): what the program computes, not the positions the
    rule selects (`Trace.computed_positions`): the record's "rows" — S at a full call; at a cached call its bucket,
    the smallest of `buckets` holding the batch's count of positions to compute (in the batch-invariant mode the
    row's own), padding rows included — each over the `keys` keys it reads (S)."""
    del computed
    return cost.trunk_flops(config, float(record["rows"]), float(keys))

  def update(self, state: DKVCacheState, output: ForwardOutput, context: Any, decision: Decision) -> DKVCacheState:
    del output
    s = self.layout.seq_len
    rows = jnp.broadcast_to(jnp.where(decision.full, s, decision.bucket_rows(s)[1]), state.rows.shape)
    was_masked = context.unresolved
    if self.layout.logit_shift and self.cache_type == "prefill":
      was_masked = jnp.where(_step_in_block(self, context) == 0, context.unresolved, state.was_masked)
    return DKVCacheState(was_masked=was_masked, rows=rows.astype(jnp.int32))


@dataclasses.dataclass(frozen=True)
class SparseDLLM(sparse_dllm.SparseDLLMSettings, ComputePolicy):
  """Sparse-dLLM as a policy: state [B, L, n_keep + keep_sinks + keep_first] int32, each layer's kept keys
  chosen at step 1 of the current block from the score of the block's mean query against every key
  (`query_key_scores`). With block diffusion's exact cache (`RunLayout.cache` "block", ours) the keys are chosen
  among the cached prefix [0, s), int(s x keep_ratio) of them (padded with S up to n_keep, the last block's
  count; `sparse_dllm.keep_prefix_positions`), and the family keeps the cache (`init_cache`: none here).

  keep_sinks (ours, not the paper's: "sinks in the loop"): also keep, per layer, the keys among the K with the
  most incoming attention at that step (summed over every query, head mean: the attention-sinks papers'
  metric) that the score did not keep and that lie outside the block (0: the official rule).
  keep_first (ours): also keep the sequence's first keep_first positions (outside the block) — the extra sink
  token of a model trained with one (paper B) sits at position 0, and the binaries keep it (keep_first >= 1)
  whenever such a model decodes under this policy (0: the official rule).
  """

  keep_sinks: int = 0
  keep_first: int = 0

  def check_knobs(self) -> None:
    sparse_dllm.SparseDLLMSettings.check(self)
    for name in ("keep_sinks", "keep_first"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"sparse_dllm {name} must be an integer >= 0, got {value!r}.")

  def check(self, config: ModelConfig | None = None, family_name: str | None = None) -> None:
    """The knobs (the settings' check, also run at construction) and, for a run, the block layout."""
    self.check_knobs()
    for name in ("keep_sinks", "keep_first"):
      if self.layout is not None and getattr(self, name) > self.layout.seq_len - self.layout.block_length:
        raise ValueError(f"sparse_dllm {name}={getattr(self, name)} is more than the "
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
    return jnp.full((batch, config.n_layers, self._n_keep() + self.keep_sinks + self.keep_first), self.layout.seq_len,
                    jnp.int32)

  def init_cache(self, config: ModelConfig, batch: int, seq_len: int, dtype: Any = jnp.float32) -> Any:
    """Block diffusion keeps its own exact KV cache, which the policy only reads subsets of: no cache here (())."""
    if self.layout.cache == "block":
      return ()
    return super().init_cache(config, batch, seq_len, dtype)

  def record(self, state: jax.Array) -> jax.Array:
    """[B, L, n_keep + keep_sinks + keep_first] int32: each layer's kept keys for the current block (S: none)."""
    return state

  def call_flops(self, config: ModelConfig, computed: np.ndarray, keys: float, record: np.ndarray) -> float:
    """Trunk FLOPs of one row's call (`ComputePolicy.call_flops`): what the program computes, not the keys the
    queries see or read (`Trace.keys_read`). A call that read every key it sees (`keys` S, or with block diffusion's
    exact cache up to its last query: a full call, a Fast-dLLM cache's call 1, block diffusion's prefill, commits and
    a block's calls 0 and 1) runs its queries over all S cached positions (block diffusion masks the unseen ones, as
    without a policy); a call over the kept keys runs them over the record's m gathered slots (record [L, m]: the
    static n_keep + keep_sinks + keep_first, padded slots included — a kept key inside the prefix cache's window, a
    sink the score already kept, an early block of block diffusion's cache that keeps fewer) and their own. A key
    subset that holds every key it sees is counted as a call over every key."""
    rows = np.flatnonzero(computed)
    sees = rows[-1] + 1 if self.layout is not None and self.layout.cache == "block" else computed.shape[-1]
    read = computed.shape[-1] if keys >= sees else np.shape(record)[-1] + rows.size
    return cost.trunk_flops(config, float(rows.size), float(read))

  def query_weights(self, state: jax.Array, context: Any) -> jax.Array:
    """[B, 2, T]: 1 on every query; 1 / block_length on the current block's queries (their mean), 0 elsewhere."""
    start = _block_start(self, context)
    index = context.query_index
    in_block = (index >= start) & (index < start + self.layout.block_length)
    weights = jnp.stack([jnp.ones(index.shape, jnp.float32), in_block.astype(jnp.float32) / self.layout.block_length])
    return jnp.broadcast_to(weights[None], (context.tokens.shape[0], 2, index.shape[0]))

  def _sinks(self, output: ForwardOutput, kept: jax.Array, start: jax.Array) -> jax.Array:
    """[L, B, keep_sinks] int32: per layer the top keep_sinks keys by incoming attention, S where the score kept
    one already or it may not be kept (`_not_outside`)."""
    s = self.layout.seq_len
    incoming = output.stats["incoming_attention"][:, :, 0, 0]  # [L, B, S]
    sinks = jax.lax.top_k(incoming, self.keep_sinks)[1].astype(jnp.int32)
    taken = jnp.any(sinks[..., :, None] == kept[..., None, :], axis=-1)
    return jnp.where(self._not_outside(sinks, start) | taken, s, sinks)

  def _first(self, kept: jax.Array, start: jax.Array) -> jax.Array:
    """[L, B, keep_first] int32: positions 0 .. keep_first − 1, S where already kept or not to be kept
    (`_not_outside`)."""
    first = jnp.broadcast_to(jnp.arange(self.keep_first, dtype=jnp.int32), kept.shape[:-1] + (self.keep_first,))
    taken = jnp.any(first[..., :, None] == kept[..., None, :], axis=-1)
    return jnp.where(self._not_outside(first, start) | taken, self.layout.seq_len, first)

  def _not_outside(self, positions: jax.Array, start: jax.Array) -> jax.Array:
    """positions may not be kept: in the block [start, start + L) — under block diffusion's cache, at or after
    start (the block and the later blocks, which its queries do not see)."""
    if self.layout.cache == "block":
      return positions >= start
    return (positions >= start) & (positions < start + self.layout.block_length)

  def decide(self, state: jax.Array, context: Any) -> Decision:
    """Steps 0 and 1 of a block full; later the block's queries over the kept keys. On a logit-shifted model
    (Dream) the position before the block is computed too (its output predicts the block's first position) and
    left out of the kept keys (UNVERIFIED: the official Dream sampler is not in our index; guide). With the
    sampler's prefix or dual cache, `_decide_cached`; with block diffusion's exact cache, `_decide_block`."""
    if self.layout.cache == "block":
      return self._decide_block(state, context)
    if self.layout.cache != "none":
      return self._decide_cached(state, context)
    shift = self.layout.logit_shift
    start = _block_start(self, context) - shift
    block = start + jnp.arange(self.layout.block_length + shift, dtype=jnp.int32)
    queries = jnp.broadcast_to(block[None, :], (context.tokens.shape[0], block.shape[0]))
    keys = jnp.swapaxes(state, 0, 1)
    if shift:
      keys = jnp.where(keys == start, self.layout.seq_len, keys)
    return Decision(full=sparse_dllm.is_full_step(_step_in_block(self, context)), queries=queries, keys=keys)

  def _decide_cached(self, state: jax.Array, context: Any) -> Decision:
    """Sparse-dLLM with a Fast-dLLM cache (ours, not the paper's; guide): a block's step 0 is the cache's refresh
    (full); its later steps compute the cache's query window — the block (dual cache) or the block and every
    later position (prefix cache, at the smallest of the blocks' window sizes, `Decision.buckets`) — at step 1
    over every cached position (the cache's own call, which scores the keys, as the official step 1 does), from
    step 2 over the kept keys outside the window only. The window is the block's on Dream too (its cached calls
    read no output before the block)."""
    layout = self.layout
    s, start = layout.seq_len, _block_start(self, context)
    width = layout.block_length if layout.cache == "dual" else s - layout.gen_start
    window = start + jnp.arange(width, dtype=jnp.int32)
    queries = jnp.broadcast_to(jnp.where(window < s, window, s)[None, :], (context.tokens.shape[0], width))
    keys = jnp.swapaxes(state, 0, 1)
    keys = jnp.where((keys >= start) & (keys < start + width), s, keys)
    step = _step_in_block(self, context)
    sizes = (width - k * layout.block_length for k in range(max(width // layout.block_length, 1)))
    buckets = tuple(sorted(sizes)) if layout.cache == "prefix" else ()
    return Decision(full=step == 0, queries=queries, keys=keys, all_keys=step == 1, buckets=buckets)

  def _decide_block(self, state: jax.Array, context: Any) -> Decision:
    """Sparse-dLLM with block diffusion's exact KV cache (ours, not the paper's; no official code for LLaDA2;
    guide): a block's decoding calls compute the block (the call's queries at the cache offset, the family's own
    cached call) — at its calls 0 and 1 over every cached key it sees (call 1 scores them, as the official step
    1), from call 2 over each layer's kept keys of the prefix [0, s) and the block's own; the prefill and the
    commits (`block_step` −1: they write the cache, so they read every key and the cache stays exact) are
    full."""
    queries = jnp.broadcast_to(context.query_index[None, :].astype(jnp.int32),
                               (context.tokens.shape[0], context.n_queries))
    return Decision(full=sparse_dllm.is_full_step(_step_in_block(self, context)), queries=queries,
                    keys=jnp.swapaxes(state, 0, 1))

  def update(self, state: jax.Array, output: ForwardOutput, context: Any, decision: Decision) -> jax.Array:
    scores = output.stats["query_key_scores"][:, :, 1]  # [L, B, S]
    start = _block_start(self, context)
    keep = sparse_dllm.keep_prefix_positions if self.layout.cache == "block" else sparse_dllm.keep_positions

    def choose():
      kept = jnp.stack([keep(layer_scores, start, self.layout.block_length, self)
                        for layer_scores in scores])  # one layer at a time: the torch top-k replay
      if self.keep_sinks:
        kept = jnp.concatenate([kept, self._sinks(output, kept, start)], axis=-1)
      if self.keep_first:
        kept = jnp.concatenate([kept, self._first(kept, start)], axis=-1)
      return jnp.swapaxes(kept, 0, 1)

    return jax.lax.cond(sparse_dllm.is_selection_step(_step_in_block(self, context)), choose, lambda: state)


POLICIES: dict[str, type[ComputePolicy]] = {"dkv_cache": DKVCache, "sparse_dllm": SparseDLLM, "d2cache": D2Cache,
                                             "dllm_cache": DLLMCache, "elastic_cache": ElasticCache,
                                             "sparsed": SparseD}
"""The runnable policies by name (`dlm_jax.policy.registry`)."""
