"""A subset call at one of a few static query-row counts (`ComputeSubset.buckets`): the smallest bucket holding
every row's real queries (entries < S; ascending, so they come first), by a `lax.switch` over one program per
count, each running the call's first `size` queries and padding its outputs back to the call's T rows with
zeros, so every branch returns the same shapes.

The bucket is the batch's. Inside `dlm_jax.sampling.row_by_row.forward_rows` the batch is one row, so each row
runs at the bucket of its own count; the loop's `lax.map` keeps the switch a conditional that runs one branch
(under `vmap` it would become a select computing every branch).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from dlm_jax.instrument.stats import STATISTICS, ForwardOutput
from dlm_jax.model.compute_subset import ComputeSubset
from dlm_jax.model.forward_inputs import CallInstruments, Compute


def halvings(largest: int, count: int) -> tuple[int, ...]:
  """`count` static row counts for `ComputeSubset.buckets`: largest and its successive halves, rounded up,
  ascending and distinct (fewer than count when the halves meet at 1)."""
  return tuple(sorted({-(-largest // 2 ** k) for k in range(count)}))


def check_buckets(subset: ComputeSubset, shape: tuple[int, int], window) -> None:
  """Raises ValueError unless the `ComputeSubset`'s buckets ascend, distinct, from 1 to T, and it is a plain
  query subset (no refresh or reuse) read out without a window."""
  buckets = subset.buckets
  if subset.queries is None or subset.refresh is not None or subset.reuse is not None:
    raise ValueError("ComputeSubset.buckets run a query subset (queries given) without refresh, reuse or key "
                     "blocks.")
  if list(buckets) != sorted(set(buckets)) or buckets[0] < 1 or buckets[-1] != shape[1]:
    raise ValueError(f"ComputeSubset.buckets must be ascending distinct sizes >= 1 ending at the T={shape[1]} "
                     f"queries, got {buckets}.")
  if window is not None:
    raise ValueError("ComputeSubset.buckets read out every query row; leave Readout.window None.")


def first_queries(instruments: CallInstruments, size: int) -> CallInstruments:
  """The instruments of the call's first `size` queries: the pairwise bias's query rows and the query-group
  weights [B, Q, :size] (the hooks are in sequence coordinates, unchanged)."""
  bias, weights = instruments.bias, instruments.query_weights
  pairwise = bias.pairwise
  if pairwise is not None and pairwise.shape[-2] != 1:
    bias = bias.replace(pairwise=pairwise[..., :size, :])
  return instruments.replace(bias=bias, query_weights=None if weights is None else weights[:, :, :size])


def pad_queries(output: ForwardOutput, n: int) -> ForwardOutput:
  """output of a call of `size` queries with its query rows padded with zeros to n: logits / hidden states
  [B, n, ...], each statistic with a query axis "T" (`STATISTICS`) n long there."""
  def pad(x: jax.Array | None, axis: int) -> jax.Array | None:
    if x is None:
      return None
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, n - x.shape[axis])
    return jnp.pad(x, widths)

  stats = {name: pad(x, STATISTICS[name].axes.index("T")) if "T" in STATISTICS[name].axes else x
           for name, x in output.stats.items()}
  return output.replace(logits=pad(output.logits, 1), hidden=pad(output.hidden, 1), stats=stats)


def bucket_index(buckets: tuple[int, ...], queries: jax.Array, n_seq: int, per_row: bool = False) -> jax.Array:
  """int32: the index of the smallest of buckets holding every row's real queries (queries [B, T] < n_seq) — a
  scalar, or [B] with per_row (each row's own count)."""
  count = jnp.sum(queries < n_seq, axis=-1).astype(jnp.int32)
  if not per_row:
    count = jnp.max(count)
  return jnp.searchsorted(jnp.asarray(buckets, jnp.int32), count, side="left").astype(jnp.int32)


def bucket_call(run: Callable[..., ForwardOutput], tokens: jax.Array, positions: jax.Array | None,
                instruments: CallInstruments, compute: Compute) -> ForwardOutput:
  """`run(tokens, positions=, instruments=, compute=)` (the forward, params, config and readout bound) for tokens
  [B, T] at the smallest of `compute.subset.buckets` holding the real queries, outputs padded to T query rows."""
  subset = compute.subset
  n = tokens.shape[1]

  def at(size: int):
    def branch():
      rows = subset.replace(queries=subset.queries[:, :size], buckets=())
      output = run(tokens[:, :size], positions=None if positions is None else positions[:, :size],
                   instruments=first_queries(instruments, size), compute=compute.replace(subset=rows))
      return pad_queries(output, n)
    return branch

  index = bucket_index(subset.buckets, subset.queries, compute.cache.keys.shape[2])
  return jax.lax.switch(index, [at(size) for size in subset.buckets])
