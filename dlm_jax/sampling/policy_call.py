"""A model call under a compute policy's `Decision` (`dlm_jax.policy`), applied by the model caller with fixed
shapes: one `lax.cond` between the full call (every query, the policy's KV cache rewritten) and the subset call
(the decision's query positions through every layer, the other positions' keys and values read from the cache,
each layer's key subset when the decision has one, or all S cached positions at a call whose `all_keys` is true);
with key blocks, the forward's own `lax.cond` between the full call and the block-sparse call (every query, each
head's query block over its kept key blocks only; `ComputeSubset.full`, the decision's `full` per row: in the
batch-invariant mode each row takes its own branch, the model running one row at a time); with a layer refresh,
always the
subset call (from the refresh start on every position); with a reuse schedule, `reuse_call`'s per-layer
reuse. The subset call's rows come back in sequence coordinates:
hidden states or logits of the positions it did not compute are zeros (d2Cache's convention for logits: a
sampler ranking confidences sees 1/V there), and its statistics are over the S sequence positions (a statistic
with a query axis "T", e.g. "attention_rows", has its rows put at the computed positions, zeros elsewhere).
Hooks run in every call: a subset call's captures hold its computed positions' activations and zeros elsewhere
(`dlm_jax.instrument.query_rows`), and its edits act at the positions it computes.

Buckets (`Decision.buckets`): a subset whose size varies per step runs at the smallest of a few static row counts
that holds the step's largest real count (`lax.switch` over one subset program per size), so every step computes all
its queries and no more than the bucket: XLA compiles each size, and a step's FLOPs are those of its bucket. With
`Decision.row_buckets` (the batch-invariant mode) each row runs at the smallest bucket holding its own count
instead: the subset call carries the buckets (`ComputeSubset.buckets`) and the row-by-row forward switches per row
(`dlm_jax.model.query_buckets`). For a policy that reads it, the largest softmax probability of the logits at every
computed position comes back in `ForwardOutput.max_probability` (from the hidden states through the LM head when the
readout is hidden states: the head on the computed rows only; a full call whose readout is a window runs the head on
all S rows, as the official d2Cache's confidence cache reads every generated position). A subset call whose logits
readout window is shorter than its rows runs the LM head on the window's rows only (the other computed rows' logits
are never read): d2Cache's row buckets, dKV-Cache's generated rows and Elastic-Cache's query budget pay the head for
the sampler's block, not for every row they compute.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from dlm_jax.core.attention_bias import AttentionBias
from dlm_jax.instrument.stats import STATISTICS, ForwardOutput
from dlm_jax.model.block_sparse_attention import block_keys_read
from dlm_jax.model.compute_subset import ComputeSubset, gather_rows, scatter_rows
from dlm_jax.model.forward_inputs import CallInstruments, Readout
from dlm_jax.policy.base import Decision
from dlm_jax.sampling import reuse_call
from dlm_jax.sampling.call_plan import PolicyState


def computed_positions(decision: Decision, batch: int, n_seq: int) -> jax.Array:
  """[B, S] bool: the sequence positions the call computed."""
  if decision.queries is None:
    return jnp.ones((batch, n_seq), bool)
  subset = scatter_rows(jnp.zeros((batch, n_seq), bool), decision.queries,
                        jnp.ones(decision.queries.shape, bool))
  return jnp.where(decision.full, True, subset)


def keys_read(decision: Decision, n_seq: int) -> jax.Array:
  """[B] float32: the keys each computed query read at the call, averaged over the layers (S at a full call or
  without a key subset; else each layer's valid kept keys plus the valid queries; with key blocks the kept
  blocks' positions, averaged over layers, heads and queries)."""
  batch = decision.queries.shape[0] if decision.queries is not None else 1
  everything = jnp.full((batch,), n_seq, jnp.float32)
  if decision.key_blocks is not None:
    return jnp.where(decision.full, n_seq, block_keys_read(decision.key_blocks, n_seq))
  if decision.keys is None:
    return everything
  own = jnp.sum(decision.queries < n_seq, axis=-1).astype(jnp.float32)
  subset = jnp.mean(jnp.sum(decision.keys < n_seq, axis=-1).astype(jnp.float32), axis=0) + own
  every = decision.full if decision.all_keys is None else decision.full | decision.all_keys
  return jnp.where(every, everything, subset)


def family_cache_forward(run: Callable[..., ForwardOutput], decision: Decision, cache: Any, offset: jax.Array,
                         tokens: jax.Array, positions: jax.Array, instruments: CallInstruments,
                         readout: Readout) -> ForwardOutput:
  """A cached call of a family that keeps its own exact KV cache (block diffusion, `RunLayout.cache` "block")
  under a key-subset decision: tokens, positions [B, T], the queries at sequence positions offset..offset+T−1
  (decision.queries); cache: the family's `KVCache`. Full: the family's own cached call (every key it sees);
  else the same queries over each layer's kept keys (decision.keys [L, B, m]) and their own, through the model's
  key-subset path (block-causal visibility from the gathered positions). Both write the queries' keys and values
  into the cache at offset; their statistics and readout are in the call's coordinates, as without a policy."""
  call = functools.partial(run, tokens, positions=positions, instruments=instruments, readout=readout, cache=cache,
                           cache_offset=offset)
  return jax.lax.cond(decision.full, lambda: call(),
                      lambda: call(subset=ComputeSubset(decision.queries, decision.keys)))


def _window(x: jax.Array, readout: Readout) -> jax.Array:
  """The readout window's rows of x [B, S, ...] (with its traced offset)."""
  if readout.window is None:
    return x
  start, stop = readout.window
  if isinstance(readout.offset, int) and readout.offset == 0:
    return x[:, start:stop]
  return jax.lax.dynamic_slice_in_dim(x, start + readout.offset, stop - start, axis=1)


def _query_rows(bias: AttentionBias, queries: jax.Array) -> AttentionBias:
  """The bias with its pairwise rows [.., B|1, N|1, S|1, S] taken at queries [B, n]."""
  pairwise = bias.pairwise
  if pairwise is None or pairwise.shape[-2] == 1:
    return bias
  axis = pairwise.ndim - 2
  index = jnp.minimum(queries, pairwise.shape[-1] - 1)
  shape = [1] * pairwise.ndim
  shape[axis - 2], shape[axis] = index.shape[0], index.shape[1]
  full = jnp.broadcast_to(pairwise, pairwise.shape[:axis - 2] + (index.shape[0],) + pairwise.shape[axis - 1:])
  return bias.replace(pairwise=jnp.take_along_axis(full, index.reshape(shape), axis=axis))


def _query_axis_to_sequence(name: str, x: jax.Array, queries: jax.Array, n_seq: int) -> jax.Array:
  """Statistic `name`'s value with its query axis "T" (size n, at queries [B, n]) put in sequence coordinates
  (size S, zeros at the positions not computed); other statistics unchanged."""
  axes = STATISTICS[name].axes
  if "T" not in axes:
    return x
  batch_axis, query_axis = axes.index("B"), axes.index("T")
  rows = jnp.moveaxis(x, (batch_axis, query_axis), (0, 1))
  placed = scatter_rows(jnp.zeros((rows.shape[0], n_seq) + rows.shape[2:], rows.dtype), queries, rows)
  return jnp.moveaxis(placed, (0, 1), (batch_axis, query_axis))


def _max_probability(rows: jax.Array, head: Callable[[jax.Array], jax.Array] | None) -> jax.Array:
  """[B, n] float32 largest softmax probability of logits [B, n, V], or of head(hidden [B, n, D])."""
  logits = rows if head is None else head(rows)
  return jnp.max(jax.nn.softmax(logits.astype(jnp.float32), axis=-1), axis=-1)


@dataclasses.dataclass(frozen=True)
class Confidence:
  """The largest probability a policy reads of a call (`ForwardOutput.max_probability`).

  max_probability: the policy's `reads_max_probability`, "never", "full" or "every"; head: hidden states
  [B, n, D] -> logits [B, n, V] (the LM head, params bound), used for it when the readout is hidden states,
  and for a subset call's logits on the readout window (`policy_forward`).
  """

  max_probability: str = "never"
  head: Callable[[jax.Array], jax.Array] | None = None


NO_CONFIDENCE = Confidence()


def policy_forward(run: Callable[..., ForwardOutput], policy: PolicyState, decision: Decision, tokens: jax.Array,
                   positions: jax.Array, instruments: CallInstruments, readout: Readout,
                   confidence: Confidence = NO_CONFIDENCE) -> ForwardOutput:
  """The call's `ForwardOutput` (logits or hidden states of the readout window, statistics over the S
  positions, the policy's new cache) under `decision`. ``run(tokens, positions=, instruments=, readout=,
  **compute_fields)`` is the forward with params, config and the attention path bound (`compute_fields`: the
  other `Compute` fields); tokens, positions: [B, S]; instruments: the call's `CallInstruments` over the S
  positions — bias (a pairwise part's rows are taken at the subset's queries), statistics spec, query-group
  weights [B, Q, S] or None, the `HookCall` (flags [B, S]) or None; confidence: the largest probability
  the policy reads (`Confidence`)."""
  window = None if readout.window is None else readout.window
  bias, weights = instruments.bias, instruments.query_weights
  n_seq = tokens.shape[1]
  max_probability, lm_head = confidence.max_probability, confidence.head
  head = lm_head if readout.hidden else None

  def full(_):
    if max_probability != "never" and window is not None and lm_head is not None:
      return full_every_row()
    output = run(tokens, positions=positions, instruments=instruments, readout=readout.replace(window=window),
                 cache=policy.cache, cache_offset=0)
    if max_probability == "never":
      return output
    rows = output.hidden if readout.hidden else output.logits
    start = 0 if window is None else window[0] + readout.offset
    placed = jax.lax.dynamic_update_slice_in_dim(jnp.zeros((rows.shape[0], n_seq), jnp.float32),
                                                 _max_probability(rows, head), start, axis=1)
    return output.replace(max_probability=placed)

  def full_every_row():
    """The full call whose readout is a window, with the largest probability at every position (the official
    d2Cache confidence cache holds every generated position's): the LM head on all S rows."""
    output = run(tokens, positions=positions, instruments=instruments, readout=Readout(hidden=True),
                 cache=policy.cache, cache_offset=0)
    rows = jax.lax.dynamic_slice_in_dim(output.hidden, window[0] + readout.offset, window[1] - window[0], axis=1)
    output = output.replace(max_probability=_max_probability(output.hidden, lm_head))
    return output.replace(hidden=rows) if readout.hidden else output.replace(hidden=None, logits=lm_head(rows))

  def head_on_window(n: int) -> bool:
    """Whether a subset call of n rows reads logits through the LM head on the readout window's rows (fewer than
    n) instead of on its n computed rows: a logits readout, a head given, no largest probability of every
    computed row asked for."""
    return (not readout.hidden and lm_head is not None and max_probability != "every" and window is not None
            and window[1] - window[0] < n)

  def subset_rows(n: int, row_buckets: bool = False):
    """The subset call of the queries' first n columns; with row_buckets each row runs at its own bucket of
    decision.buckets (n their last) inside the row-by-row forward (`ComputeSubset.buckets`)."""
    buckets = decision.buckets if row_buckets else ()

    def subset(refresh):
      queries = decision.queries[:, :n]
      real = (queries < n_seq).astype(jnp.float32)
      sub_weights = None
      if weights is not None:
        sub_weights = jnp.take_along_axis(weights, jnp.minimum(queries, n_seq - 1)[:, None, :],
                                          axis=2) * real[:, None, :]
      window_head = head_on_window(n)
      call = functools.partial(run, gather_rows(tokens, queries), positions=gather_rows(positions, queries),
                               instruments=instruments.replace(bias=_query_rows(bias, queries),
                                                               query_weights=sub_weights),
                               readout=Readout(hidden=readout.hidden or window_head), cache=policy.cache)
      part = ComputeSubset(queries, decision.keys, refresh, buckets=buckets)
      if decision.all_keys is None or decision.keys is None:
        output = call(subset=part)
      else:  # a Fast-dLLM cache's call before the keys are chosen reads every cached position
        output = jax.lax.cond(decision.all_keys, lambda: call(subset=part.replace(keys=None)),
                              lambda: call(subset=part))
      rows = output.hidden if readout.hidden or window_head else output.logits
      placed = _window(scatter_rows(jnp.zeros((rows.shape[0], n_seq, rows.shape[2]), rows.dtype), queries, rows),
                       readout)
      if window_head:  # the LM head on the window's rows only (bias-free: zero rows give zero logits)
        output = output.replace(hidden=None)
        placed = lm_head(placed)
      output = output.replace(stats={name: _query_axis_to_sequence(name, x, queries, n_seq)
                                     for name, x in output.stats.items()})
      if max_probability != "never":
        probability = _max_probability(rows, head) if max_probability == "every" else jnp.zeros(queries.shape)
        output = output.replace(max_probability=scatter_rows(jnp.zeros((rows.shape[0], n_seq), jnp.float32),
                                                             queries, probability))
      return output.replace(hidden=placed) if readout.hidden else output.replace(logits=placed)
    return subset

  def blocks():
    full_rows = jnp.broadcast_to(decision.full, tokens.shape[:1])
    return run(tokens, positions=positions, instruments=instruments, readout=readout.replace(window=window),
               cache=policy.cache, cache_offset=0,
               subset=ComputeSubset(None, key_blocks=decision.key_blocks, full=full_rows))

  if decision.reuse is not None:
    return reuse_call.reuse_forward(run, policy.cache, decision.reuse, tokens, positions, instruments, readout)
  if decision.key_blocks is not None:
    return blocks()
  if decision.queries is None:
    return full(None)
  if decision.refresh is not None:  # a layer refresh: every call is a subset call, full starts at layer 0
    return subset_rows(decision.queries.shape[1])(decision.refresh.replace(
        tokens=tokens, positions=positions, start=jnp.where(decision.full, 0, decision.refresh.start)))
  n = decision.queries.shape[1]
  buckets = decision.buckets or (n,)
  if buckets[-1] != n or list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
    raise ValueError(f"Decision.buckets must be ascending distinct sizes >= 1 ending at the queries' {n}, "
                     f"got {buckets}.")
  if len(buckets) == 1:
    subset = subset_rows(n)
  elif decision.row_buckets:  # each row at its own bucket, inside the row-by-row forward
    subset = subset_rows(n, row_buckets=True)
  else:
    branches = [subset_rows(size) for size in buckets]
    subset = lambda _: jax.lax.switch(decision.bucket_rows(n_seq)[0], branches, None)  # noqa: E731
  return jax.lax.cond(decision.full, full, subset, None)
