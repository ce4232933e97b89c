"""Elastic-Cache (arXiv 2510.14973) as a compute policy: the rule module `dlm_jax.policy.elastic_cache` decides
the query set, the layer refresh (`dlm_jax.model.layer_refresh`) applies it inside the forward.

Per call after the first: the queries are the tracked tokens (per layer the `track_num` most-attended
non-masked tokens of the previous call), the positions decoded at the previous call and the first
`window_length` still-masked positions (every still-masked one without block caching); every layer before a
row's first drifted one runs only them; from the layer after it every position is recomputed. Call 0 runs
every position through every layer.

Decoding is the sampler's: the policy decides compute only. It runs with the exact LLaDA sampler and with
threshold or factor decoding without a KV cache (`llada_blockwise`, cache "none"); the window is the first
`window_length` still-masked positions from the sampler's current block (`CallContext.block_start`), so it holds
the block's candidates whenever window_length >= the block (or the sampler's own window). The official decoding
(`generate_with_elastic_cache`: threshold 0.9 over the sliding window, at least the best token, EOS truncation)
is `llada.elastic_cache_options()` (`LLaDAOptions.window`, `eos_truncation`); under EOS truncation the policy's
still-masked set stops at the cut as the official one does (`RunLayout.eos_cut_id`), so masks after the cut
are neither in the window nor zeroed in the tracked-token score. Replayed against the official loop
(tests/test_policy_elastic_cache_runs.py): the exact sampler's blocks and the official threshold decoding.

Dream (`dream`, `dream_blockwise` without a cache, and `dream_window`), as the official Dream code does it
(`dream/model/generation_utils_elastic.py` `_sample`, `dream/model/modeling_dream.py` `DreamSdpaAttention`,
read through the mirror yxu-dev/Elastic-Cache): its logits are AR-shifted (the output at p − 1 predicts p), so
the masked queries are the positions before the window's masked ones (before every still-masked one without
block caching), those rows are the tracked-token statistic's rows, the still-masked positions themselves
(unshifted) are zeroed in its score, and the window the sampler decodes from is unshifted. Decoding is Dream's
sampler's: its quota, Fast-dLLM's threshold or factor rule in blocks, or the official Dream decoding
(`dream.elastic_cache_options()`: `_sample`'s threshold 0.9 over the sliding window, at least the best token,
EOS truncation with the config's EOS id; `DreamOptions.window`, `eos_truncation`, `dlm_jax.sampling.dream_window`),
whose EOS cut the policy follows as on LLaDA. Replayed against the official loop
(tests/test_policy_elastic_cache_dream.py: the per-call computation under each, the official decoding whole).
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
from dlm_jax.model.layer_refresh import LayerRefresh
from dlm_jax.policy import cost
from dlm_jax.policy import elastic_cache as ec
from dlm_jax.policy.base import ComputePolicy, Decision
from dlm_jax.policy.positions import ascending_positions

FAMILIES = ("llada", "llada_blockwise", "dream", "dream_blockwise", "dream_window")
"""The sampler families it runs with: LLaDA and MMaDA, and Dream with its shifted queries (module docstring),
exact or threshold / factor decoding (without a KV cache: `blocks.check_policy_cache`), and Dream's Elastic-Cache
decoding (`dream_window`)."""


@struct.dataclass
class ElasticState:
  """was_unresolved [B, S] bool: the positions unresolved at the previous call; tracked [B, R] int32 (R = L ·
  track_num): the previous call's tracked tokens, ascending, padded with S; hidden [B, L, S, D] float32: each
  layer's input as last computed; start [B] int32: the previous call's first refreshed layer (L: none);
  queries [B, n] int32: the previous call's query set (padded with S); eos_cut [B] int32: the sampler's EOS
  cut as of the previous call (`ec.update_eos_cut`; S: none)."""

  was_unresolved: jax.Array
  tracked: jax.Array
  hidden: jax.Array
  start: jax.Array
  queries: jax.Array
  eos_cut: jax.Array


@dataclasses.dataclass(frozen=True)
class ElasticCache(ComputePolicy):
  """Elastic-Cache's compute knobs (`ElasticCacheSettings`: window_length 16, gamma 0.9, track_num 1,
  block_caching True, the official defaults)."""

  NAME = "elastic_cache"
  window_length: int = 16
  gamma: float = 0.9
  track_num: int = 1
  block_caching: bool = True

  def __post_init__(self):
    self.check_knobs()

  @property
  def settings(self) -> ec.ElasticCacheSettings:
    """The rule module's settings for these knobs (the decoding knobs unused: the sampler decodes)."""
    return ec.ElasticCacheSettings(window_length=self.window_length, gamma=self.gamma, track_num=self.track_num,
                                   block_caching=self.block_caching, threshold=None)

  def check_knobs(self) -> None:
    self.settings.check()

  def check(self, config: ModelConfig | None = None, family_name: str | None = None) -> None:
    """The knobs and, for a run, the family, the model and the block layout (one line each)."""
    self.check_knobs()
    if family_name is not None and family_name not in FAMILIES:
      raise ValueError(f"policy elastic_cache runs with the {', '.join(FAMILIES)} samplers (LLaDA, MMaDA, Dream: "
                       f"exact, threshold or factor decoding), not {family_name}.")
    if config is not None and (config.layer_pattern is not None or config.first_k_dense):
      raise ValueError(f"policy elastic_cache runs on models with one stack of alike bidirectional layers (LLaDA, "
                       f"MMaDA, Dream), not {config.name}.")
    layout = self.layout
    if layout is None or not self.block_caching:
      return
    span = min(layout.block_length, layout.decoding_window or layout.block_length)
    if self.window_length < span:
      what = (f"block_length={layout.block_length}" if span == layout.block_length
              else f"decoding window={layout.decoding_window}")
      raise ValueError(f"elastic_cache window_length={self.window_length} is shorter than the sampler's {what}: "
                       f"the candidates would not be computed; use window_length >= {span} or block_caching=false.")

  def required_stats(self, config: ModelConfig) -> StatsSpec:
    """Incoming attention (head mean) of one query group: the call's masked query rows."""
    del config
    return StatsSpec(incoming_attention=True, per_head=False, query_groups=1)

  def _budget(self, config: ModelConfig) -> int:
    return self.settings.query_budget(config.n_layers, self.layout.seq_len)

  def init_state(self, config: ModelConfig, batch: int) -> ElasticState:
    s = self.layout.seq_len
    return ElasticState(was_unresolved=jnp.ones((batch, s), bool),
                        tracked=jnp.full((batch, config.n_layers * self.track_num), s, jnp.int32),
                        hidden=jnp.zeros((batch, config.n_layers, s, config.d_model), jnp.float32),
                        start=jnp.zeros((batch,), jnp.int32),
                        queries=jnp.full((batch, self._budget(config)), s, jnp.int32),
                        eos_cut=jnp.full((batch,), s, jnp.int32))

  def _pending(self, state: ElasticState, context: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(the official still-masked set of the call [B, S] bool: the masked generated positions, up to the EOS cut
    under the sampler's truncation; the cut [B] int32 (S: none); decoded_last [B, S] bool: the generated
    positions decoded at the previous call)."""
    layout = self.layout
    generated = jnp.arange(layout.seq_len)[None, :] >= layout.gen_start
    decoded_last = state.was_unresolved & ~context.unresolved & generated
    cut = state.eos_cut
    if layout.eos_cut_id is not None:
      cut = ec.update_eos_cut(cut, decoded_last, context.tokens == layout.eos_cut_id)
    return ec.pending_mask(context.unresolved & generated, cut), cut, decoded_last

  def _sets(self, state: ElasticState, context: Any) -> tuple[jax.Array, jax.Array]:
    """(queries [B, S] bool, masked query rows [B, S] bool: the rows whose attention picks the tracked tokens).
    The window is the first window_length still-masked positions from the sampler's current block on; on a
    logit-shifted model (Dream) the masked query rows are the positions before the window's (every pending
    one's without block caching)."""
    s, shifted = self.layout.seq_len, bool(self.layout.logit_shift)
    pending, _, decoded_last = self._pending(state, context)
    block_start = self.layout.gen_start if context.block_start is None else context.block_start
    from_block = pending & (jnp.arange(s)[None, :] >= block_start)
    tracked = ec.tracked_mask(jnp.minimum(state.tracked, s)[None], s + 1)[:, :s]
    queries, window = ec.query_mask(self.settings, tracked, decoded_last, from_block, shifted=shifted)
    masked = window if self.block_caching else pending
    if shifted:
      masked = ec.predecessors(masked)
    return queries | masked, masked

  def query_weights(self, state: ElasticState, context: Any) -> jax.Array:
    """[B, 1, S]: 1 on the call's masked query rows."""
    return self._sets(state, context)[1][:, None, :].astype(jnp.float32)

  def decide(self, state: ElasticState, context: Any) -> Decision:
    s = self.layout.seq_len
    queries, _ = self._sets(state, context)
    index, valid = ascending_positions(queries, state.queries.shape[1])
    n_layers = state.hidden.shape[1]
    refresh = LayerRefresh(hidden=jnp.swapaxes(state.hidden, 0, 1), tracked=state.tracked,
                           start=jnp.full(state.start.shape, n_layers, jnp.int32), gamma=float(self.gamma))
    return Decision(full=jnp.asarray(context.step, jnp.int32) == 0,
                    queries=jnp.where(valid, index, s).astype(jnp.int32), refresh=refresh)

  def update(self, state: ElasticState, output: ForwardOutput, context: Any, decision: Decision) -> ElasticState:
    s = self.layout.seq_len
    incoming = output.stats["incoming_attention"][:, :, 0, 0]  # [L, B, S]
    pending, cut, _ = self._pending(state, context)
    per_layer = jax.vmap(lambda scores: ec.track_tokens(scores, pending, self.track_num))(incoming)
    tracked, valid = ascending_positions(ec.tracked_mask(per_layer, s), state.tracked.shape[1])
    return ElasticState(was_unresolved=context.unresolved, tracked=jnp.where(valid, tracked, s).astype(jnp.int32),
                        hidden=jnp.swapaxes(output.refresh.hidden, 0, 1).astype(state.hidden.dtype),
                        start=output.refresh.start, queries=decision.queries, eos_cut=cut)

  def call_flops(self, config: ModelConfig, computed: np.ndarray, keys: float, record: dict) -> float:
    """`cost.layer_refresh_flops`: the call's queries below its refresh start, every position from it on, and
    the drift test of the tracked slots (L × track_num) at every layer."""
    del computed, keys
    s = self.layout.seq_len
    rows = float(np.sum(np.asarray(record["queries"]) < s))
    return cost.layer_refresh_flops(config, rows, s, config.n_layers * self.track_num, int(record["refresh_start"]))

  def record(self, state: ElasticState) -> dict:
    """{"refresh_start": [B] int32, the call's first layer recomputed for every position (L: none, 0: the
    whole call), "queries": [B, n] int32, the positions run through every layer (padded with S)}."""
    return {"refresh_start": state.start, "queries": state.queries}
