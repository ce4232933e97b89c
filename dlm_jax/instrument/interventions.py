"""Attention-bias interventions: static descriptions plus traced state, applied at every model call.

An `Intervention` is a frozen (hashable) dataclass, so it is part of a compiled program's static key; the
arrays that vary between conditions or steps (positions, K, ε, validity masks) live in its *state*, a
pytree carried through the sampler loop, so one compiled program serves every condition. The call plan
(`dlm_jax.sampling.call_plan`: the samplers' model calls and `intervened_forward`, the plain forward) does, at
every model call:

    context = CallContext(step=i, tokens=sequence)   # KV cache: also query_offset=offset, query_length=T
    record = intervention.record(state)                      # optional: what this call will apply
    bias = intervention.bias(state, context)                 # AttentionBias for this call
    weights = intervention.query_weights(state, context)     # None, or [B, Q, T] (see below)
    output = forward(params, sequence, bias=bias, ...)       # statistics: the StatsPlan's union
    state = intervention.update(state, output, context)      # e.g. remember this call's sinks

Protocol (every method has a do-nothing default in `Intervention`):
  required_stats(config) -> StatsSpec: the statistics `update` reads. If its `query_groups` Q > 0 the
    call plan passes `query_weights(state, context)` ([B, Q, T]) to the forward, beside the groups of the
    statistics a user asks for (`dlm_jax.sampling.stats_plan.StatsPlan`). The statistics it receives are its
    own view of the call's, in the library's one layout ([L', B, Q, N', S], `dlm_jax.instrument.stats`).
  init_state(config, batch_size, seq_len) -> pytree: initial state for [batch_size, seq_len] sequences
    (seq_len = the KV-cache length S for cached decoding).
  bias(state, context) -> AttentionBias: additive biases [… T|1, S] for this call, with T =
    `context.n_queries` (S unless the sampler sets query_length; a sampler that leaves it unset and feeds
    fewer queries slices the query axis of a pairwise bias itself). Masks use
    `dlm_jax.model.attention.MASK_VALUE` (finite: no NaN even when a row loses every key; such a row becomes
    uniform over all keys). Its per-layer flags give every layer its own bias.
  query_weights(state, context) -> [B, Q, T] or None: query-group weights for the statistics.
  update(state, output, context) -> state: called once after every model call with its `ForwardOutput`.
  record(state) -> pytree or None: what the next call applies, for a per-step record (the samplers stack
    it into `Trace.intervention_record` when asked). The sink maskers record the keys they mask: the masks
    of call t, computed from the statistics of call t−1.
`update` must run exactly once per model call (with CFG: on the conditional half's statistics).

Interventions here: `MaskKeys` (given keys, optionally per layer and head, optionally sparing each query's
own key), `KeyPadding` (key padding or Dream's outer-product mask), `SinkToken` (the extra sink token of
*One Token Is Enough*), `MaskPreviousSinks` (Rulli et al.'s top-K sinks of the previous step),
`MaskPreviousSinksAR` (the autoregressive variant: sinks of the previous call's last query row), and
`Compose`. Shapes use the axis letters of `dlm_jax.model.attention`.

Memory: key biases cost O(L·B·N·S) per call; pairwise biases ("spare self", the sink token, the
outer-product padding) cost O(B·T·S), and O(L·B·N·T·S) when they differ per layer and head (spare self
with per-(layer, head) sink masks: about L·N·S²·4 bytes per sequence, 1.4 GB for LLaDA-8B at S = 600).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import struct

from dlm_jax.instrument import sink_selection
from dlm_jax.core.attention_bias import MASK_VALUE, NO_BIAS, AttentionBias
from dlm_jax.config import ModelConfig
from dlm_jax.instrument.stats import NO_STATS, ForwardOutput, StatsSpec, merge_specs


@struct.dataclass
class CallContext:
  """What an intervention may read about the model call it biases.

  step: scalar int32, the index of the model call within the sampler run (0 for a plain forward).
  tokens: [B, S] the whole sequence of the call (all S key positions; with a KV cache, the sequence of cache
    length S, positions not yet written holding anything).
  query_offset: scalar int (may be traced), sequence index of the call's first query (the cache offset).
  query_length: static int, the number T of queries fed at this call, or None for all S (a full forward).
  unresolved: [B, T] bool or None, the call's queries playing the mask role (set by the samplers).
  query_valid: [B, T] bool or None, the call's real (not padding) queries (set by the samplers).
  gen_start: static int, the sequence index where generation starts (set by the samplers).
  block_start: scalar int32 or None, the first sequence position of the sampler's current semi-autoregressive
    block (set by the block samplers; a block of a threshold or factor mode takes a variable number of calls).
  block_step: scalar int32 or None, the calls the current block has had before this one (0 at its first).
  """

  step: jax.Array
  tokens: jax.Array
  query_offset: jax.Array | int = 0
  query_length: int | None = struct.field(pytree_node=False, default=None)
  unresolved: jax.Array | None = None
  query_valid: jax.Array | None = None
  gen_start: int = struct.field(pytree_node=False, default=0)
  block_start: jax.Array | None = None
  block_step: jax.Array | None = None

  @property
  def n_queries(self) -> int:
    """T, the number of queries of the call."""
    return self.tokens.shape[1] if self.query_length is None else self.query_length

  @property
  def query_index(self) -> jax.Array:
    """[T] sequence index of every query of the call."""
    return self.query_offset + jnp.arange(self.n_queries)


@dataclasses.dataclass(frozen=True)
class Intervention:
  """Base class: no bias, no state, no statistics needed. Subclasses override what they use."""

  def required_stats(self, config: ModelConfig) -> StatsSpec:
    """Statistics `update` needs from every model call."""
    del config
    return NO_STATS

  def init_state(self, config: ModelConfig, batch_size: int, seq_len: int) -> Any:
    """Initial traced state for a run over [batch_size, seq_len] token sequences."""
    del config, batch_size, seq_len
    return ()

  def bias(self, state: Any, context: CallContext) -> AttentionBias:
    del state, context
    return NO_BIAS

  def query_weights(self, state: Any, context: CallContext) -> jax.Array | None:
    """[B, Q, T] query-group weights to pass to the forward when required_stats().query_groups = Q > 0."""
    del state, context
    return None

  def update(self, state: Any, output: ForwardOutput, context: CallContext) -> Any:
    del output, context
    return state

  def record(self, state: Any) -> Any:
    """Per-call record of what the next call applies (a pytree of arrays), or None for nothing."""
    del state
    return None

  def keep_rows(self, new: Any, old: Any, active: jax.Array) -> Any:
    """The state after a call for the rows that decoded (active [B] bool) and `old` for the rows that
    waited (a sampler whose rows wait for the batch, e.g. threshold decoding), so that a row's state does
    not depend on its batch. Interventions whose `update` changes the state override this."""
    del old, active
    return new


NO_INTERVENTION = Intervention()


# ----------------------------------------------------------------------------------------------------------
# Bias builders (pure functions)


def key_mask_bias(masked: jax.Array, per_layer_head: bool = False) -> AttentionBias:
  """Key bias removing keys, True = masked: masked [B, S] (all layers and heads), or [L, B, N, S] per layer
  and head when `per_layer_head`."""
  values = jnp.where(masked, MASK_VALUE, 0.0).astype(jnp.float32)
  if per_layer_head:
    return AttentionBias(keys=values, keys_per_layer=True)
  return AttentionBias(keys=values[:, None, :])


def spare_self_bias(masked: jax.Array, query_index: jax.Array, per_layer_head: bool = False) -> AttentionBias:
  """Pairwise bias removing the masked keys from every query except the key at the query's own position.

  masked: [B, S], or [L, B, N, S] when `per_layer_head`; query_index: [T]. Returns pairwise [B, 1, T, S]
  or per layer [L, B, N, T, S].
  """
  own = query_index[:, None] == jnp.arange(masked.shape[-1])[None, :]
  if not per_layer_head:
    masked = masked[:, None]
  pairwise = jnp.where(masked[..., None, :] & ~own, MASK_VALUE, 0.0).astype(jnp.float32)
  return AttentionBias(pairwise=pairwise, pairwise_per_layer=per_layer_head)


def padding_bias(valid: jax.Array, outer: bool = False, query_index: jax.Array | None = None) -> AttentionBias:
  """Padding mask from valid [B, S] bool (True = real token).

  outer=False: no query sees a padded key (key bias [B, 1, S]). outer=True: Dream/MMaDA's outer product,
  query i sees key j iff valid[i] and valid[j] (pairwise [B, 1, T, S] for queries `query_index` [T],
  default 0..S−1); padded query rows see nothing, which MASK_VALUE turns into a finite uniform row.
  """
  if not outer:
    return key_mask_bias(~valid)
  if query_index is None:
    query_index = jnp.arange(valid.shape[1])
  query_valid = jnp.take(valid, query_index, axis=1, mode="clip")
  allowed = query_valid[:, :, None] & valid[:, None, :]
  return AttentionBias(pairwise=jnp.where(allowed, 0.0, MASK_VALUE).astype(jnp.float32)[:, None])


def sink_token_bias(is_sink: jax.Array, query_index: jax.Array) -> AttentionBias:
  """Eq. 6 of *One Token Is Enough*: the query row of a sink token sees only its own key; every other
  row is unchanged (so every token may attend to the sink). is_sink: [B, S] bool; query_index: [T].
  Returns pairwise [B, 1, T, S]."""
  sink_rows = jnp.take(is_sink, query_index, axis=1, mode="clip")
  own = query_index[:, None] == jnp.arange(is_sink.shape[1])[None, :]
  removed = sink_rows[:, :, None] & ~own[None]
  return AttentionBias(pairwise=jnp.where(removed, MASK_VALUE, 0.0).astype(jnp.float32)[:, None])


# ----------------------------------------------------------------------------------------------------------
# Fixed masks


@dataclasses.dataclass(frozen=True)
class MaskKeys(Intervention):
  """Removes given key positions from every query's view.

  State: a bool array, True = masked: [B, S] for all layers and heads, or [L, B, N, S] when
  `per_layer_head`. The positions are data (fill them with `with_positions` or set the array directly),
  so one compiled program serves every choice. `spare_self`: a query still sees the key at its own
  position (pairwise bias, O(S²) memory; see the module docstring).
  """

  per_layer_head: bool = False
  spare_self: bool = False

  def init_state(self, config: ModelConfig, batch_size: int, seq_len: int) -> jax.Array:
    if self.per_layer_head:
      return jnp.zeros((config.n_layers, batch_size, config.n_heads, seq_len), bool)
    return jnp.zeros((batch_size, seq_len), bool)

  @staticmethod
  def with_positions(state: jax.Array, positions: jax.Array) -> jax.Array:
    """Also marks key `positions` [B, P] (int; −1 = none) as masked, in all layers and heads."""
    batch, seq_len = positions.shape[0], state.shape[-1]
    rows = jnp.arange(batch)[:, None]
    valid = positions >= 0
    marks = jnp.zeros((batch, seq_len), bool).at[rows, jnp.where(valid, positions, 0)].max(valid)
    # [B, S] against [B, S] state, or [B, 1, S] broadcast over the layers and heads of [L, B, N, S] state
    return state | marks.reshape(batch, *([1] * (state.ndim - 3)), seq_len)

  def bias(self, state: jax.Array, context: CallContext) -> AttentionBias:
    if self.spare_self:
      return spare_self_bias(state, context.query_index, self.per_layer_head)
    return key_mask_bias(state, self.per_layer_head)

  def record(self, state: jax.Array) -> jax.Array:
    """The masked keys of the call: [B, S] or [L, B, N, S] bool."""
    return state


@dataclasses.dataclass(frozen=True)
class KeyPadding(Intervention):
  """Padding mask. State: valid [B, S] bool (True = real token), all True initially (data).

  pad_token_id: when set, validity is also read from the sequence (`context.tokens` != pad_token_id).
    Beware: LLaDA and Dream use the EOS id as pad id, so generated EOS tokens would be masked too; prefer
    the state mask there.
  outer: Dream/MMaDA's outer-product mask (padded queries see nothing) instead of key padding only.
  """

  pad_token_id: int | None = None
  outer: bool = False

  def init_state(self, config: ModelConfig, batch_size: int, seq_len: int) -> jax.Array:
    del config
    return jnp.ones((batch_size, seq_len), bool)

  def bias(self, state: jax.Array, context: CallContext) -> AttentionBias:
    valid = state if self.pad_token_id is None else state & (context.tokens != self.pad_token_id)
    return padding_bias(valid, self.outer, context.query_index)


@dataclasses.dataclass(frozen=True)
class SinkToken(Intervention):
  """The extra sink token of *One Token Is Enough* (papers.md §B.3): its query row attends only to itself,
  every token may attend to it. The sequence must already hold the sink token (see `add_sink_token`).

  position: "front" (index 0, the paper's default) or "end" (index S−1).
  zero_value: replace the sink's value vector by zeros (Table 5), through the model's `zero_values`.
  State: is_sink [B, S] bool (data: any set of positions may be sinks; each sink row sees only itself).
  """

  position: Literal["front", "end"] = "front"
  zero_value: bool = False

  def __post_init__(self):
    if self.position not in ("front", "end"):
      raise ValueError(f"SinkToken.position must be 'front' or 'end', got {self.position!r}.")

  def init_state(self, config: ModelConfig, batch_size: int, seq_len: int) -> jax.Array:
    del config
    return jnp.zeros((batch_size, seq_len), bool).at[:, sink_token_index(self.position, seq_len)].set(True)

  def bias(self, state: jax.Array, context: CallContext) -> AttentionBias:
    bias = sink_token_bias(state, context.query_index)
    return bias.replace(zero_values=state) if self.zero_value else bias


def sink_token_index(position: Literal["front", "end"], seq_len: int) -> int:
  """Sequence index of the sink token in a sequence of seq_len positions that includes it."""
  return 0 if position == "front" else seq_len - 1


def add_sink_token(tokens: jax.Array, sink_token_id: int, position: Literal["front", "end"] = "front") -> jax.Array:
  """[B, T] -> [B, T+1] with the sink token id inserted at the front or the end."""
  sink = jnp.full((tokens.shape[0], 1), sink_token_id, tokens.dtype)
  return jnp.concatenate([sink, tokens] if position == "front" else [tokens, sink], axis=1)


def remove_sink_token(x: jax.Array, position: Literal["front", "end"] = "front", axis: int = 1) -> jax.Array:
  """Drops the sink position (first or last entry along `axis`, e.g. of logits [B, T+1, V])."""
  n = x.shape[axis]
  return jax.lax.slice_in_dim(x, 1, n, axis=axis) if position == "front" else jax.lax.slice_in_dim(x, 0, n - 1,
                                                                                                     axis=axis)


# ----------------------------------------------------------------------------------------------------------
# Sinks of the previous step


@struct.dataclass
class PreviousSinksState:
  """State of `MaskPreviousSinks` / `MaskPreviousSinksAR` (all data).

  masked: bool, the keys masked at the *next* model call: [L, B, N, S] per (layer, head), or [B, S] when
    global. After a call it holds that call's top-K sinks.
  top_k: [B] int32, K per sequence (0 = no masking).
  epsilon: [B] float32, ε of the ε-rule restricting the sinks (−inf = no restriction).
  eligible: [B, S] bool, keys that may be chosen as sinks.
  """

  masked: jax.Array
  top_k: jax.Array
  epsilon: jax.Array
  eligible: jax.Array


@dataclasses.dataclass(frozen=True)
class MaskPreviousSinks(Intervention):
  """Rulli et al.'s sink masking (papers.md §A.5): at call t, the top-K sinks measured at call t−1 get
  MASK_VALUE (so they receive exactly zero attention and the rows renormalise over the other keys).

  Sinks at call t−1 are ranked by the incoming attention recorded at that call (column sums over all
  queries, computed under call t−1's own mask): per (layer, head) by default — masked in the same
  (layer, head), the paper's literal reading — or globally (`per_head=False`: ranked by the mean over
  layers and heads of the column sums, which keeps the ε scale, and masked in every layer and head).
  Ties go to the lower position. With `epsilon` only keys passing the ε-rule (over all S keys, with
  `normalise`) are kept, so fewer than K may be masked. Keys masked at t−1 receive zero attention there,
  so they are chosen again only when fewer than K keys have positive attention.

  First call: `initial_keys` (e.g. (0,) for the BOS token; negative indices count from the end) are
  masked in every layer and head; none by default. K, ε, the eligible keys and the first mask are state
  (`PreviousSinksState`), so one compiled program serves K = 0, 1, 5, 10 (`with_top_k`). Each call must
  see the whole sequence ([B, S] tokens, statistics over S keys).
  `spare_self`: each query keeps its own key (pairwise bias; O(L·N·S²) memory per sequence per head).
  """

  top_k: int = 1
  per_head: bool = True
  epsilon: float | None = None
  normalise: sink_selection.Normalise = "sum"
  spare_self: bool = False
  initial_keys: tuple[int, ...] = ()

  def __post_init__(self):
    if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
      raise ValueError(f"{type(self).__name__}.top_k must be an integer >= 0, got {self.top_k!r}.")
    if self.normalise not in ("sum", "mean", "zscore"):
      raise ValueError(f"normalise must be 'sum', 'mean' or 'zscore', got {self.normalise!r}.")
    if not isinstance(self.initial_keys, tuple):
      raise ValueError(f"initial_keys must be a tuple of positions, got {self.initial_keys!r}.")

  def required_stats(self, config: ModelConfig) -> StatsSpec:
    del config
    return StatsSpec(incoming_attention=True, per_head=True)

  def init_state(self, config: ModelConfig, batch_size: int, seq_len: int) -> PreviousSinksState:
    first = jnp.zeros((seq_len,), bool)
    for index in self.initial_keys:
      if not -seq_len <= index < seq_len:
        raise ValueError(f"initial_keys {self.initial_keys} fall outside a sequence of {seq_len} keys.")
      first = first.at[index].set(True)
    shape = (config.n_layers, batch_size, config.n_heads, seq_len) if self.per_head else (batch_size, seq_len)
    epsilon = -jnp.inf if self.epsilon is None else self.epsilon
    return PreviousSinksState(masked=jnp.broadcast_to(first, shape),
                              top_k=jnp.full((batch_size,), self.top_k, jnp.int32),
                              epsilon=jnp.full((batch_size,), epsilon, jnp.float32),
                              eligible=jnp.ones((batch_size, seq_len), bool))

  @staticmethod
  def with_top_k(state: PreviousSinksState, top_k: jax.Array | int) -> PreviousSinksState:
    """State with K (scalar or [B]) replaced."""
    return state.replace(top_k=jnp.broadcast_to(jnp.asarray(top_k, jnp.int32), state.top_k.shape))

  @staticmethod
  def with_epsilon(state: PreviousSinksState, epsilon: jax.Array | float) -> PreviousSinksState:
    """State with ε (scalar or [B]; −inf = no ε restriction) replaced."""
    return state.replace(epsilon=jnp.broadcast_to(jnp.asarray(epsilon, jnp.float32), state.epsilon.shape))

  @staticmethod
  def masked_keys(state: PreviousSinksState) -> jax.Array:
    """The keys the next call masks: [L, B, N, S] or [B, S] bool (what `record` returns)."""
    return state.masked

  def bias(self, state: PreviousSinksState, context: CallContext) -> AttentionBias:
    if self.spare_self:
      return spare_self_bias(state.masked, context.query_index, self.per_head)
    return key_mask_bias(state.masked, self.per_head)

  def record(self, state: PreviousSinksState) -> jax.Array:
    """The keys masked at the call: [L, B, N, S] per (layer, head), or [B, S] when global."""
    return state.masked

  def _scores(self, output: ForwardOutput) -> jax.Array:
    """Per-key sink scores of the call from its [L, B, 1, N, S] incoming attention: [L, B, N, S] per head,
    [B, S] global."""
    if output.incoming_attention is None:
      raise ValueError(f"{type(self).__name__} needs per-head incoming attention of every layer; call the "
                       "forward with intervention.required_stats(config).")
    incoming = output.incoming_attention[:, :, 0]
    return incoming if self.per_head else incoming.mean(axis=(0, 2))

  def keep_rows(self, new: PreviousSinksState, old: PreviousSinksState, active: jax.Array) -> PreviousSinksState:
    rows = active[None, :, None, None] if self.per_head else active[:, None]
    return new.replace(masked=jnp.where(rows, new.masked, old.masked))

  def update(self, state: PreviousSinksState, output: ForwardOutput, context: CallContext) -> PreviousSinksState:
    del context
    scores = self._scores(output)
    if self.per_head:
      k, eps, eligible = state.top_k[None, :, None], state.epsilon[None, :, None, None], state.eligible[None, :, None]
    else:
      k, eps, eligible = state.top_k, state.epsilon[:, None], state.eligible
    masked = sink_selection.top_k_sinks(scores, k, eps=eps, normalise=self.normalise, candidates=eligible)
    return state.replace(masked=masked)


@dataclasses.dataclass(frozen=True)
class MaskPreviousSinksAR(MaskPreviousSinks):
  """Autoregressive variant (papers.md §A.5): the keys masked at decoding iteration t are the top-K keys of
  the attention of the *last query row* of iteration t−1, per (layer, head) or globally (mean over layers
  and heads). No ε-rule (a single row sums to 1).

  `last_row_weights=False` (default): reads the plain per-head incoming attention of the call (no query
  groups, no weights; works with any sampler and equals the statistics a sampler records): exactly the
  last row at T = 1 KV-cache steps, but the column sums over all prompt queries at the prefill, so the
  first decode step masks the prompt's top-K keys by column sum rather than by the last prompt row.
  `last_row_weights=True`: exact at the prefill too: `required_stats` asks for one query group and
  `query_weights` gives the one-hot weight of the call's last query (row T−1), so the sampler must pass
  `query_weights(state, context)` to the forward and set `CallContext.query_length` = T for calls that
  feed fewer than S queries.
  With a KV cache, init_state's seq_len is the cache length S and the masks address cache positions.
  """

  last_row_weights: bool = False

  def __post_init__(self):
    super().__post_init__()
    if self.epsilon is not None:
      raise ValueError("MaskPreviousSinksAR has no ε-rule: one attention row cannot pass it; leave epsilon None.")

  def required_stats(self, config: ModelConfig) -> StatsSpec:
    del config
    return StatsSpec(incoming_attention=True, per_head=True, query_groups=int(self.last_row_weights))

  def query_weights(self, state: PreviousSinksState, context: CallContext) -> jax.Array | None:
    del state
    if not self.last_row_weights:
      return None
    b, t = context.tokens.shape[0], context.n_queries
    return jnp.broadcast_to(jax.nn.one_hot(t - 1, t, dtype=jnp.float32), (b, 1, t))


# ----------------------------------------------------------------------------------------------------------
# Composition


@dataclasses.dataclass(frozen=True)
class Compose(Intervention):
  """Applies several interventions together: biases add (clamped at MASK_VALUE), each keeps its own state
  (a tuple, in `parts` order). At most one part may need query weights."""

  parts: tuple[Intervention, ...] = ()

  def required_stats(self, config: ModelConfig) -> StatsSpec:
    spec = NO_STATS
    for part in self.parts:
      spec = merge_specs(spec, part.required_stats(config))
    return spec

  def init_state(self, config: ModelConfig, batch_size: int, seq_len: int) -> tuple[Any, ...]:
    return tuple(p.init_state(config, batch_size, seq_len) for p in self.parts)

  def bias(self, state: tuple[Any, ...], context: CallContext) -> AttentionBias:
    total = NO_BIAS
    for part, part_state in zip(self.parts, state):
      total = total + part.bias(part_state, context)
    return total

  def query_weights(self, state: tuple[Any, ...], context: CallContext) -> jax.Array | None:
    weights = [w for p, s in zip(self.parts, state) if (w := p.query_weights(s, context)) is not None]
    if len(weights) > 1:
      raise ValueError("Compose: more than one part supplies query weights; compose at most one such part.")
    return weights[0] if weights else None

  def update(self, state: tuple[Any, ...], output: ForwardOutput, context: CallContext) -> tuple[Any, ...]:
    return tuple(p.update(s, output, context) for p, s in zip(self.parts, state))

  def keep_rows(self, new: tuple[Any, ...], old: tuple[Any, ...], active: jax.Array) -> tuple[Any, ...]:
    return tuple(p.keep_rows(n, o, active) for p, n, o in zip(self.parts, new, old))

  def record(self, state: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """The parts' records, in `parts` order (None for a part that records nothing); None if none does."""
    records = tuple(p.record(s) for p, s in zip(self.parts, state))
    return None if all(r is None for r in records) else records


def flat_parts(intervention: Intervention) -> tuple[Intervention, ...]:
  """The interventions `intervention` applies, in order: itself, or its `Compose` parts (nested ones
  flattened); for samplers that refuse some of them."""
  if not isinstance(intervention, Compose):
    return (intervention,)
  return tuple(leaf for part in intervention.parts for leaf in flat_parts(part))


def refuse_end_sink_token(intervention: Intervention, sampler: str, why: str) -> None:
  """Raises when `intervention` holds `SinkToken(position="end")`, which `sampler` cannot run (`why`)."""
  if any(isinstance(part, SinkToken) and part.position == "end"
         for part in flat_parts(intervention)):
    raise ValueError(f"SinkToken(position='end') cannot run with {sampler}: {why}; use position='front' (the sink "
                     "as the prompt's first token).")
