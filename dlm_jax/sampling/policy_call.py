"""A model call under a compute policy's `Decision` (`dlm_jax.policy`), applied by the model caller with fixed
shapes: one `lax.cond` between the full call (every query, the policy's KV cache rewritten) and the subset call
(the decision's query positions through every layer, the other positions' keys and values read from the cache,
each layer's key subset when the decision has one), or, with key blocks, between the full call and the
block-sparse call (every query, each head's query block over its kept key blocks only). The subset call's rows
come back in sequence coordinates: hidden states or logits of the positions it did not compute are zeros
(d2Cache's convention for logits: a sampler ranking confidences sees 1/V there), and its statistics are over the
S sequence positions.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from dlm_jax.core.attention_bias import AttentionBias
from dlm_jax.instrument.stats import ForwardOutput
from dlm_jax.model.block_sparse_attention import block_keys_read
from dlm_jax.model.compute_subset import ComputeSubset, gather_rows, scatter_rows
from dlm_jax.policy.base import Decision
from dlm_jax.sampling import reuse_call
from dlm_jax.sampling.call_inputs import Readout
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
  return jnp.where(decision.full, everything, subset)


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


def policy_forward(run: Callable[..., ForwardOutput], params, policy: PolicyState, decision: Decision,
                   tokens: jax.Array, positions: jax.Array, bias: AttentionBias, weights: jax.Array | None,
                   readout: Readout) -> ForwardOutput:
  """The call's `ForwardOutput` (logits or hidden states of the readout window, statistics over the S
  positions, the policy's new cache) under `decision`. ``run(params, tokens, **kwargs)`` is the forward (with
  config, stats_spec and the attention path bound); tokens, positions: [B, S]; bias: the call's bias over the S
  queries (a pairwise part's rows are taken at the subset's queries); weights: [B, Q, S] query-group weights or
  None."""
  window = None if readout.window is None else readout.window

  def full(_):
    return run(params, tokens, bias=bias, positions=positions, query_weights=weights, logits_window=window,
               logits_offset=readout.offset, cache=policy.cache, cache_offset=0, return_hidden=readout.hidden)

  def subset(refresh):
    queries = decision.queries
    real = (queries < tokens.shape[1]).astype(jnp.float32)
    sub_weights = None
    if weights is not None:
      sub_weights = jnp.take_along_axis(weights, jnp.minimum(queries, tokens.shape[1] - 1)[:, None, :],
                                        axis=2) * real[:, None, :]
    output = run(params, gather_rows(tokens, queries), bias=_query_rows(bias, queries),
                 positions=gather_rows(positions, queries),
                 query_weights=sub_weights, cache=policy.cache, return_hidden=readout.hidden,
                 subset=ComputeSubset(queries, decision.keys, refresh))
    rows = output.hidden if readout.hidden else output.logits
    placed = _window(scatter_rows(jnp.zeros((rows.shape[0], tokens.shape[1], rows.shape[2]), rows.dtype), queries,
                                  rows), readout)
    return output.replace(hidden=placed) if readout.hidden else output.replace(logits=placed)

  def blocks(_):
    return run(params, tokens, bias=bias, positions=positions, query_weights=weights, logits_window=window,
               logits_offset=readout.offset, cache=policy.cache, cache_offset=0, return_hidden=readout.hidden,
               subset=ComputeSubset(None, key_blocks=decision.key_blocks))

  if decision.reuse is not None:
    return reuse_call.reuse_forward(run, params, policy.cache, decision.reuse, tokens, positions, bias, weights,
                                    readout)
  if decision.key_blocks is not None:
    return jax.lax.cond(decision.full, full, blocks, None)
  if decision.queries is None:
    return full(None)
  if decision.refresh is not None:  # a layer refresh: every call is a subset call, full starts at layer 0
    return subset(decision.refresh.replace(tokens=tokens, positions=positions,
                                           start=jnp.where(decision.full, 0, decision.refresh.start)))
  return jax.lax.cond(decision.full, full, subset, None)
