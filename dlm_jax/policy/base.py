"""The compute-policy protocol: statistics of model call t decide what call t+1 computes (DESIGN decision 13).

A `ComputePolicy` is a frozen (hashable) dataclass — part of the compiled program's key — with traced state
carried from call to call, like an `Intervention`. The call plan (`dlm_jax.sampling.call_plan`) asks it, before
every model call of a run, for a `Decision`, and the model caller applies it with fixed shapes:

  * full (traced bool): compute every query of the call (a refresh: warm-up steps, block starts, reload
    intervals, drift triggers) and rewrite the policy's KV cache;
  * queries [B, n] (static n, traced positions; an entry equal to S is padding): otherwise compute only these
    sequence positions — every other position's keys and values are read from the policy's KV cache;
  * keys [L, B, m] (static m): otherwise each layer reads only these cached positions besides the call's own
    queries (a key subset; None reads all S);
  * key_blocks (a `KeyBlocks` [L, B, N, nQb, m], static m; instead of queries and keys): otherwise every query is
    computed and each head's query block reads only these key blocks (block-sparse attention, SparseD).

After the call, `update` sees the call's statistics (its `required_stats`, in sequence coordinates) and the
decision it took. Protocol (every method has a do-nothing default here):

  required_stats(config) -> StatsSpec: the statistics `update` reads.
  check(config, family_name) -> None: raises ValueError (one line) when the policy cannot run there.
  bind(layout) -> ComputePolicy: the policy with the run's static `RunLayout` (sequence length, generation
    start, block length, steps per block); the driver binds it before anything else.
  init_state(config, batch) -> pytree, every array with the batch as its leading axis.
  init_cache(config, batch, seq_len, dtype) -> the cache the model caller reads and rewrites (a `KVCache`
    [L, B, S, K, H]; a reuse policy's `ReuseCache`), every array with the batch on axis 1.
  decide(state, context) -> Decision: `context` is the call's `CallContext` (step, tokens [B, S], the
    unresolved positions, gen_start).
  query_weights(state, context) -> [B, Q, T]: the weights of its own query groups (when its required_stats
    has query_groups Q > 0; e.g. the current block's queries for Sparse-dLLM's score).
  update(state, output, context, decision) -> state: once after every model call (output.cache: the call's
    new cache).
  reads_max_probability -> "never" | "full" | "every": the calls whose per-position largest softmax
    probability `update` reads (`ForwardOutput.max_probability`; e.g. d2Cache's confidence cache).
  record(state) -> pytree or None: what the policy decided, read from its state after each call
    (`Trace.policy_record`; e.g. Sparse-dLLM's kept keys).
  call_flops(config, computed, keys, record) -> float: the analytic trunk FLOPs one row's call computed, from
    its `Trace` entries (host arrays); the default counts the computed positions through every layer, each
    reading `keys` keys (`dlm_jax.policy.cost.trunk_flops`).

A policy never changes what statistics and captures mean: they stay in sequence coordinates, and the caller
reports which positions a call computed (`StepOutput.computed`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dlm_jax.config import ModelConfig
from dlm_jax.instrument.stats import NO_STATS, ForwardOutput, StatsSpec
from dlm_jax.model.block_sparse_attention import KeyBlocks
from dlm_jax.model import query_buckets
from dlm_jax.model.cache import KVCache
from dlm_jax.policy import cost


class PolicyError(ValueError):
  """A compute policy that cannot run with this run (the model, the sampler and its options, hooks, the
  layout): one line naming the setting and what is allowed. Raised before anything is compiled."""


@struct.dataclass
class Decision:
  """What one model call computes (module docstring).

  full: scalar bool, compute every query — or, with key_blocks, [B] bool per row: in the batch-invariant mode
  (`RunSetup.batch_invariant`) each row's call is full or block-sparse as its own entry says, otherwise the call is
  full for every row when any row's is (the model caller reduces it); queries: [B, n] int32 sequence positions
  computed when not full (None: the policy never takes a query subset), ascending, padded with S (a padded entry
  computes nothing that is kept and writes nothing); keys: [L, B, m] int32 cached positions each layer reads besides
  the call's queries when not full, padded with S, or None (all S); refresh: a
  `dlm_jax.model.layer_refresh.LayerRefresh` (without tokens and positions, which the caller fills) or None: the call
  always runs the queries through a layer refresh (full sets every row's start to layer 0) and the forward's
  `RefreshResult` reaches `update` as `output.refresh`; key_blocks: a `KeyBlocks`
  (`dlm_jax.model.block_sparse_attention`, [L, B, N, nQb, m] kept key blocks per layer, head and query block, padded
  with nKb) each query block reads when not full — every query is computed, only the dropped blocks' QK^T and PV are
  skipped (SparseD) — or None; reuse: a `ReuseSchedule` (per-layer reuse of attention and feed-forward outputs,
  positions chosen inside the forward at each layer; the policy's cache is then a
  `dlm_jax.model.reuse_layers.ReuseCache`, `ComputePolicy.init_cache`), or None; buckets: static ascending row counts,
  the last n, at which the subset call may run: the caller runs the smallest that holds every row's real queries
  (padded entries sort last, so the first columns hold them), so the compute follows the count with static shapes; ()
  runs all n rows; all_keys: scalar bool or None: when true, a subset call with `keys` reads every cached position
  instead (a call of a Fast-dLLM cache before the policy has chosen its keys; `dlm_jax.sampling.policy_call`);
  row_buckets: static, set by the model caller in the batch-invariant mode (`RunSetup.batch_invariant`): each row
  runs at the smallest bucket holding its own real queries (the model run one row at a time), not the batch's.
  """

  full: jax.Array
  queries: jax.Array | None = None
  keys: jax.Array | None = None
  refresh: Any = None
  key_blocks: KeyBlocks | None = None
  reuse: Any = None
  buckets: tuple[int, ...] = struct.field(pytree_node=False, default=())
  all_keys: jax.Array | None = None
  row_buckets: bool = struct.field(pytree_node=False, default=False)

  def bucket_rows(self, n_seq: int) -> tuple[jax.Array, jax.Array]:
    """(index, size): int32, the smallest of `buckets` (or the queries' n without buckets) holding every row's
    real queries (entries < n_seq), and its row count — the rows a subset call runs; scalars, or [B] with
    `row_buckets` (each row's own)."""
    buckets = self.buckets or (self.queries.shape[1],)
    index = query_buckets.bucket_index(buckets, self.queries, n_seq, per_row=self.row_buckets)
    return index, jnp.asarray(buckets, jnp.int32)[index]


@struct.dataclass
class ReuseSchedule:
  """`Decision.reuse` (`dlm_jax.model.reuse_layers`): prompt, gen: scalar bool, the prompt [0, P) / the
  response [P, S) recomputed at every layer after the first; prompt_length: P; count: response positions each
  layer whose response is not recomputed adds by its own statistic; first_layer_full: layer 0 recomputes
  everything (static)."""

  prompt: jax.Array
  gen: jax.Array
  prompt_length: int = struct.field(pytree_node=False)
  count: int = struct.field(pytree_node=False)
  first_layer_full: bool = struct.field(pytree_node=False)


@dataclasses.dataclass(frozen=True)
class RunLayout:
  """Static facts of the run a policy decides in (`ComputePolicy.bind`).

  seq_len: S; gen_start: the first generated position; block_length: the sampler's semi-autoregressive block
  (the generation length without blocks); steps_per_block: model calls per block (the quota's; a threshold or
  factor block takes a variable number, `CallContext.block_step`); logit_shift: the model predicts position p
  from its output at p - logit_shift (Dream: 1); decoding_window: the sampler decodes among the first this many
  masks of a block (`LLaDAOptions.window`; None: the whole block); eos_cut_id: the sampler's EOS truncation
  (`LLaDAOptions.eos_truncation`: after the first call that decodes this id, the masks after it are never
  decoded; None: no truncation); cache: the sampler's Fast-dLLM KV cache ("none", "prefix" or "dual"), which a
  policy that composes with it emulates in its own decisions (`dlm_jax.sampling.blocks.CACHE_POLICIES`), or
  "block": block diffusion's exact KV cache, which the family keeps and the policy takes key subsets of;
  decoding_rule: the name of the sampler's decoding rule (`dlm_jax.sampling.decoding_rules`, e.g.
  "certainty_prior"; None: the sampler's own transfer rule).
  """

  seq_len: int
  gen_start: int
  block_length: int
  steps_per_block: int
  logit_shift: int = 0
  decoding_window: int | None = None
  eos_cut_id: int | None = None
  cache: str = "none"
  decoding_rule: str | None = None


@dataclasses.dataclass(frozen=True)
class ComputePolicy:
  """Base class: compute everything, no state (the policy `none`). layout: the run's `RunLayout`, set by
  `bind` when a run starts (None before)."""

  NAME: ClassVar[str] = "none"
  layout: RunLayout | None = None

  def bind(self, layout: RunLayout) -> ComputePolicy:
    """This policy for a run with `layout` (static)."""
    return dataclasses.replace(self, layout=layout)

  def required_stats(self, config: ModelConfig) -> StatsSpec:
    del config
    return NO_STATS

  def check(self, config: ModelConfig, family_name: str) -> None:
    del config, family_name

  def init_state(self, config: ModelConfig, batch: int) -> Any:
    """The traced state for a batch of B rows (the run's facts are in `layout`)."""
    del config, batch
    return ()

  def init_cache(self, config: ModelConfig, batch: int, seq_len: int, dtype: Any = jnp.float32) -> Any:
    """The cache of a batch of B rows of S positions: a `KVCache` (a reuse policy: its `ReuseCache`)."""
    return KVCache.zeros(config, batch, seq_len, dtype)

  def query_weights(self, state: Any, context: Any) -> jax.Array | None:
    """[B, Q, T] weights of the policy's own query groups when its required_stats has query_groups Q > 0."""
    del state, context
    return None

  def check_knobs(self) -> None:
    """Raises ValueError (one line naming the knob) for a knob out of range."""

  def record(self, state: Any) -> Any:
    """What the policy decided, from its state after a call (batch-leading arrays), for `Trace.policy_record`;
    None for nothing."""
    del state
    return None

  def call_flops(self, config: ModelConfig, computed: np.ndarray, keys: float, record: Any) -> float:
    """Trunk FLOPs (no LM head) of one row's call: computed [S] bool (its `Trace.computed_positions`), keys:
    the keys each computed query read (`Trace.keys_read`), record: its `Trace.policy_record` at the call, or
    None."""
    del record
    return cost.trunk_flops(config, float(np.sum(computed)), float(keys))

  def decide(self, state: Any, context: Any) -> Decision:
    del state, context
    return Decision(full=jnp.ones((), bool))

  def update(self, state: Any, output: ForwardOutput, context: Any, decision: Decision) -> Any:
    del output, context, decision
    return state

  @property
  def reads_max_probability(self) -> str:
    """Which calls' largest softmax probability per position `update` reads (`ForwardOutput.max_probability`,
    computed by the model caller from the call's logits): "never", "full" (the full calls only) or "every"."""
    return "never"

  @property
  def enabled(self) -> bool:
    """The policy can skip work (anything but `none`)."""
    return type(self) is not ComputePolicy


NO_POLICY = ComputePolicy()
