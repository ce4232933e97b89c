"""A subset call at one of a few static query-row counts (`ComputeSubset.buckets`, chosen by
`ComputeSubset.bucket`): a `lax.switch` over one program per count, each running the call's first `size` query
rows and padding its outputs back to the call's T rows with zeros, so every branch returns the same shapes.

The switch takes the largest index of the batch. Inside `dlm_jax.sampling.row_by_row.forward_rows` the batch is
one row, so each row runs at its own bucket; the loop's `lax.map` keeps the switch a conditional (under `vmap` it
would be a select computing every branch). A row whose real queries (entries < S, first in its row) do not fit
its bucket loses the ones past it: the caller picks the smallest bucket holding them.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from dlm_jax.instrument.stats import STATISTICS, ForwardOutput
from dlm_jax.model.forward_inputs import CallInstruments, Compute


def check_buckets(subset, shape: tuple[int, int], window) -> None:
  """Raises ValueError unless the `ComputeSubset`'s buckets ascend, distinct, from 1 to T, its bucket is [B], and
  it is a plain query subset (no refresh, reuse or key blocks) read out without a window."""
  buckets, bucket = subset.buckets, subset.bucket
  if subset.queries is None or subset.refresh is not None or subset.reuse is not None:
    raise ValueError("ComputeSubset.bucket runs a query subset (queries given) without refresh, reuse or key "
                     "blocks.")
  if not buckets or list(buckets) != sorted(set(buckets)) or buckets[0] < 1 or buckets[-1] != shape[1]:
    raise ValueError(f"ComputeSubset.buckets must be ascending distinct sizes >= 1 ending at the T={shape[1]} "
                     f"queries, got {buckets}.")
  if tuple(bucket.shape) != shape[:1]:
    raise ValueError(f"ComputeSubset.bucket must be [B] with B={shape[0]}, got {list(bucket.shape)}.")
  if window is not None:
    raise ValueError("ComputeSubset.bucket reads out every query row; leave Readout.window None.")


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


def bucket_call(run: Callable[..., ForwardOutput], tokens: jax.Array, positions: jax.Array | None,
                instruments: CallInstruments, compute: Compute) -> ForwardOutput:
  """`run(tokens, positions=, instruments=, compute=)` (the forward, params, config and readout bound) for tokens
  [B, T] at the bucket `compute.subset.buckets[max(compute.subset.bucket)]`, outputs padded to T query rows."""
  subset = compute.subset
  n = tokens.shape[1]

  def at(size: int):
    def branch():
      rows = subset.replace(queries=subset.queries[:, :size], buckets=(), bucket=None)
      output = run(tokens[:, :size], positions=None if positions is None else positions[:, :size],
                   instruments=first_queries(instruments, size), compute=compute.replace(subset=rows))
      return pad_queries(output, n)
    return branch

  return jax.lax.switch(jnp.max(subset.bucket), [at(size) for size in subset.buckets])
