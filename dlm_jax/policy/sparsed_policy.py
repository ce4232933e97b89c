"""SparseD as a compute policy: dense attention through step E, then every layer's heads read only the key blocks
chosen at step E (`dlm_jax.policy.sparsed` has the rule and its reading of the official code).

Per call: steps 0..E are full calls; at step E the forward also computes the statistic
`sparsed_pooled_attention(...)` (the block-pooled softmax probabilities of every layer, both passes, one query
block at a time from the layer's post-RoPE q and k, `pooled_statistics`), and `update` turns it into the kept
blocks per layer, head and query block (`keep_mask`). Every later call computes every query, layer and
feed-forward, and attention only over those blocks (`dlm_jax.model.block_sparse_attention`; the static count m
is the rule's maximum, min(int(nKb x select) + 1, g) + int((nKb - g) x select) + 1, padded with nKb).

Nothing is reused between calls but the mask: SparseD needs no KV cache of its own (the call plan's policy cache
is written by every call and read by none).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dlm_jax.config import ModelConfig
from dlm_jax.instrument.stats import STATISTICS, ForwardOutput, LayerValues, Statistic, StatsSpec, register_statistic
from dlm_jax.model.block_sparse_attention import KeyBlocks
from dlm_jax.policy import cost, sparsed
from dlm_jax.policy.base import ComputePolicy, Decision

FAMILIES = ("llada", "dream")
"""The samplers SparseD runs with (LLaDA and MMaDA through the LLaDA sampler, Dream)."""

BLOCK_FAMILIES = ("llada_blockwise", "dream_blockwise")
"""Their threshold and factor modes, without a cache (the caches are refused by `blocks.check_policy_cache`)."""


@struct.dataclass
class SparseDState:
  """blocks: [B, L, N, nQb, m] int32 kept key blocks per layer, head and query block (ascending, padded with
  nKb; all padding before step E); chosen: [B] bool, the blocks were chosen (step E has run); calls: [B] int32,
  the model calls the row has decoded in (a row that waits for its batch under threshold decoding keeps its
  state, `Intervention.keep_rows`, so this is the row's own step)."""

  blocks: jax.Array
  chosen: jax.Array
  calls: jax.Array


def pooled_attention_statistic(settings: sparsed.SparseDSettings, generation: int) -> str:
  """The name of the `STATISTICS` entry (registered on first use) that gives SparseD's two block-pooled maps of a
  layer for the call's last query group — the policy's own span, which the statistics plan always puts last
  (`StatsPlan.group_spans`).

  Value per layer [B, Q, 2, N, nQb, nKb] float32, zero in groups 0 .. Q − 2: with w [B, T] the last group's
  weights, index 0 the mean over each (query block, key block) of w_t · softmax(q_t k^T x scale) (all keys),
  index 1 the same with the softmax over the keys from generation x block_size on (`sparsed.pooled_statistics`;
  scale `settings.score_scale` of the layer's heads and head size). Weights that are all zero give zeros without
  computing anything, so a policy pays for it only at the step it weighs.
  """
  name = (f"sparsed_pooled_attention(block_size={settings.block_size},score_scale={settings.score_scale},"
          f"generation_block={generation})")
  if name in STATISTICS:
    return name

  def compute(layer: LayerValues) -> jax.Array:
    b, t, n, h = layer.queries.shape
    shape = (b, 2, n, -(-t // settings.block_size), -(-layer.keys.shape[1] // settings.block_size))
    weights = jnp.ones((b, 1, t), jnp.float32) if layer.query_weights is None else layer.query_weights
    scale = sparsed.score_scale(settings, n, h)

    def pooled():
      maps = sparsed.pooled_statistics(layer.queries, layer.keys, settings, scale, generation, weights[:, -1])
      return jnp.stack(maps, axis=1)

    last = jax.lax.cond(jnp.any(weights[:, -1] != 0), pooled, lambda: jnp.zeros(shape, jnp.float32))
    return jnp.concatenate([jnp.zeros((b, weights.shape[1] - 1, *shape[1:]), jnp.float32), last[:, None]], axis=1)

  register_statistic(name, Statistic(None, ("L", "B", "Q", "P", "N", "I", "J"), compute))
  return name


@dataclasses.dataclass(frozen=True)
class SparseD(sparsed.SparseDSettings, ComputePolicy):
  """SparseD as a policy (module docstring): state `SparseDState`; full calls through step E; record: the kept
  blocks [B, L, N, nQb, m] (nKb: none).

  keep_first (ours, not the paper's): the key blocks holding positions 0 .. keep_first − 1 are kept for every
  layer, head and query block besides the rule's — the extra sink token of a model trained with one (paper B)
  sits at position 0, and the binaries keep it (keep_first >= 1) whenever such a model decodes under this policy
  (`experiments.common.decoding.sink_token_kept`); 0: the official rule, which keeps no block by rule.

  Step E is the row's own model call E (`SparseDState.calls`): the sampler's step under exact decoding; under
  threshold or factor decoding (the blockwise samplers without a cache) a run makes fewer calls than `steps`, and
  E = int(steps x skip) + 1 still counts calls (a run that ends before E never chooses). `Decision.full` is per
  row (the row at or before its step E): in the batch-invariant mode each row's call is dense or sparse as its
  own; otherwise a call is dense while any row is, so in a batch whose rows wait for each other a row can get
  dense calls it would not get alone (guide, "SparseD with threshold and factor decoding").
  """

  keep_first: int = 0

  def check_knobs(self) -> None:
    sparsed.SparseDSettings.check(self)
    if isinstance(self.keep_first, bool) or not isinstance(self.keep_first, int) or self.keep_first < 0:
      raise ValueError(f"sparsed keep_first must be an integer >= 0, got {self.keep_first!r}.")

  def check(self, config: ModelConfig | None = None, family_name: str | None = None) -> None:
    """The knobs (the settings' check, also run at construction) and, for a run, the family and attention."""
    self.check_knobs()
    if family_name is not None and family_name not in FAMILIES + BLOCK_FAMILIES:
      raise ValueError(f"policy sparsed runs with the {', '.join(FAMILIES)} samplers and their threshold and factor "
                       f"modes ({', '.join(BLOCK_FAMILIES)}, no cache), not {family_name}.")
    if self.layout is not None and self.keep_first > self.layout.seq_len:
      raise ValueError(f"sparsed keep_first={self.keep_first} is more than the sequence's {self.layout.seq_len} "
                       "positions.")
    if config is not None and (config.causal or config.attention_block_size is not None
                               or config.layer_pattern is not None):
      raise ValueError(f"policy sparsed needs bidirectional attention; {config.name} is causal, block-causal or has "
                       "sliding-window layers.")

  @property
  def total_steps(self) -> int:
    layout = self.layout
    return layout.steps_per_block * max((layout.seq_len - layout.gen_start) // layout.block_length, 1)

  @property
  def selection_step(self) -> int:
    """E: the global step whose statistics choose the blocks."""
    return sparsed.warmup_end(self.total_steps, self.skip)

  @property
  def generation(self) -> int:
    """g: the first key block of the generation region."""
    layout = self.layout
    boundary = sparsed.boundary_length(self, layout.seq_len - layout.gen_start, self.total_steps)
    return sparsed.generation_block(layout.seq_len, boundary, self.block_size)

  @property
  def n_blocks(self) -> int:
    return -(-self.layout.seq_len // self.block_size)

  @property
  def first_blocks(self) -> int:
    """The key blocks holding positions 0 .. keep_first − 1."""
    return -(-self.keep_first // self.block_size)

  @property
  def kept_blocks(self) -> int:
    """m: the most key blocks the rule keeps for one head and query block (the static count), with keep_first's
    blocks (at most nKb)."""
    return min(sparsed.max_kept_blocks(self.n_blocks, self.generation, self.select) + self.first_blocks,
               self.n_blocks)

  def required_stats(self, config: ModelConfig) -> StatsSpec:
    del config
    return StatsSpec(extra=(pooled_attention_statistic(self, self.generation),), query_groups=1)

  def init_state(self, config: ModelConfig, batch: int) -> SparseDState:
    shape = (batch, config.n_layers, config.n_heads, self.n_blocks, self.kept_blocks)
    return SparseDState(blocks=jnp.full(shape, self.n_blocks, jnp.int32), chosen=jnp.zeros((batch,), bool),
                        calls=jnp.zeros((batch,), jnp.int32))

  def record(self, state: SparseDState) -> jax.Array:
    return state.blocks

  def call_flops(self, config: ModelConfig, computed: np.ndarray, keys: float, record: np.ndarray) -> float:
    """Trunk FLOPs of one row's call (`ComputePolicy.call_flops`): what the program computes, not the kept blocks'
    positions (`Trace.keys_read`). A dense call (`keys` S) runs every query over S keys; a block-sparse call every
    query block over the record's m gathered key blocks (record [L, N, nQb, m]: the static count, padded slots
    included — pass one's blocks at or after g, keep_first's already kept — and a partial last block whole,
    `cost.block_sparse_flops`)."""
    s = computed.shape[-1]
    if keys >= s:
      return cost.trunk_flops(config, s, s)
    return cost.block_sparse_flops(config, s, self.block_size, np.shape(record)[-1])

  def query_weights(self, state: SparseDState, context: Any) -> jax.Array:
    """[B, 1, T]: every query of a row at its step E, nothing (the statistic is not computed) at the other
    steps."""
    at_selection = sparsed.is_selection_step(state.calls, self.selection_step).astype(jnp.float32)  # [B]
    return jnp.broadcast_to(at_selection[:, None, None], (context.tokens.shape[0], 1, context.query_index.shape[0]))

  def decide(self, state: SparseDState, context: Any) -> Decision:
    del context
    full = sparsed.is_full_step(state.calls, self.selection_step)  # [B]
    return Decision(full=full, key_blocks=KeyBlocks(jnp.swapaxes(state.blocks, 0, 1), self.block_size))

  def update(self, state: SparseDState, output: ForwardOutput, context: Any, decision: Decision) -> SparseDState:
    del context, decision
    pooled = output.stats[pooled_attention_statistic(self, self.generation)][:, :, 0]  # [L, B, 2, N, nQb, nKb]
    n, g = self.n_blocks, self.generation
    selection = sparsed.is_selection_step(state.calls, self.selection_step)  # [B]

    def choose():
      mask = sparsed.keep_mask(pooled[:, :, 0], pooled[:, :, 1], self.select, g)  # [L, B, N, nQb, nKb]
      mask = mask | (jnp.arange(n) < self.first_blocks)
      kept = jnp.sort(jnp.where(mask, jnp.arange(n, dtype=jnp.int32), n), axis=-1)[..., :self.kept_blocks]
      row = selection.reshape((-1,) + (1,) * (kept.ndim - 1))
      return jnp.where(row, jnp.swapaxes(kept, 0, 1), state.blocks)

    blocks = jax.lax.cond(jnp.any(selection), choose, lambda: state.blocks)
    return SparseDState(blocks=blocks, chosen=state.chosen | selection, calls=state.calls + 1)
