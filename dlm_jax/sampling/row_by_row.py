"""Batch-invariant model calls: the model run one row at a time, so a row's numbers cannot depend on its batch.

XLA's CPU backend picks its matmul kernels by shape: a batched contraction of B rows can add its products in
another order than the same contraction of one row (measured on jaxlib 0.10.2: the attention's
probability-times-values contraction of one row differs in the last bit between a batch of 1 and a batch of
2 or more when it goes through a YNNPACK fusion, XLA's default; the whole forward of the embedded tiny-dlm
differs from batch 6 on; BUILD.md, "Exact batch independence"). A one-ulp difference in a logit can flip a
decoding choice and then everything after it.

`forward_rows` runs `dlm_jax.model.forward` as a `lax.map` over the rows: every row goes through the same
compiled batch-1 program whatever the batch size, and its outputs are reassembled in the batch layout. The
steps between model calls (proposals, confidences, transfers) are per-row reductions, sorts and elementwise
arithmetic; compiled without YNNPACK fusions (`CPU_COMPILER_OPTIONS`, applied by the driver) their per-row
order does not change with the number of rows. Together every row's tokens and statistics are bitwise
those of a batch of one (checked for the LLaDA, Dream, autoregressive, block-diffusion and DiffusionGemma
samplers).

One trip. At batch 1 the `lax.map` is a loop of one trip, which XLA removes, inlining the row's program
into the code around it; it is then optimised together with that code, and gets other numbers than the
loop body at batch >= 2 (measured on DiffusionGemma: the final-logit softcap's `tanh(x/30)·30` and the
sampler's division by the temperature T were folded into `tanh(x/30)·(30·(1/T))`, and the decoder's fusions
were cut differently — XLA's CPU code contracts a·b + c into a fused multiply-add inside a fusion, so
another fusion is another rounding). `_map_rows` fences the loop with optimization barriers
(`lax.optimization_barrier`: its inputs before it, its results after it), which no pass crosses: the inlined
row then gets the loop body's numbers bitwise (tests/test_batch_invariance_exact.py).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from dlm_jax.config import ModelConfig
from dlm_jax.instrument.hook_call import row_slices
from dlm_jax.core.attention_bias import AttentionBias
from dlm_jax.model.compute_subset import ComputeSubset
from dlm_jax.model import forward
from dlm_jax.model.forward_inputs import (DEFAULT_COMPUTE, FULL_READOUT, NO_INSTRUMENTS, CallInstruments, Compute,
                                          Readout)
from dlm_jax.instrument.stats import ForwardOutput

CPU_COMPILER_OPTIONS: dict[str, str] = {"xla_cpu_experimental_ynn_fusion_type": ""}
"""XLA options of a batch-invariant program on CPU: no YNNPACK fusions, whose kernels are chosen by size (a
softmax's sum over the vocabulary of [16, 8, 90] logits ran as a YNNPACK reduction, that of [5, 8, 90] as
XLA's own, which adds in another order), so reductions and matmuls are XLA's and Eigen's, whose per-row
order does not depend on the number of rows at a given row shape."""

def _split(x: jax.Array, axis: int) -> jax.Array:
  """[..., B at axis, ...] -> [B, ..., 1 at axis, ...]: the rows in front, each with a batch of one."""
  return jnp.expand_dims(jnp.moveaxis(x, axis, 0), axis + 1)


def _join(x: jax.Array, axis: int) -> jax.Array:
  """The inverse of `_split`: [B, ..., 1 at axis, ...] -> [..., B at axis, ...]."""
  return jnp.moveaxis(jnp.squeeze(x, axis + 1), 0, axis)


def _map_rows(fn, rows, shared=None):
  """fn(row, shared) for every row of `rows` (a pytree of [B, ...] arrays): `lax.map`, fenced by optimization
  barriers (inputs before the loop, results after it) so that no compiler pass joins a row's program with
  the code around it (module docstring, "One trip"). Returns fn's outputs stacked on a leading [B] axis."""
  rows, shared = jax.lax.optimization_barrier((rows, shared))
  return jax.lax.optimization_barrier(jax.lax.map(lambda row: fn(row, shared), rows))


def _bias_axes(bias: AttentionBias) -> dict[str, int]:
  return {"pairwise": int(bias.pairwise_per_layer), "keys": int(bias.keys_per_layer), "zero_values": 0}


def forward_rows(params, tokens: jax.Array, *, config: ModelConfig, positions: jax.Array,
                 instruments: CallInstruments = NO_INSTRUMENTS, readout: Readout = FULL_READOUT,
                 compute: Compute = DEFAULT_COMPUTE) -> ForwardOutput:
  """`dlm_jax.model.forward(params, tokens, ...)` for tokens [B, T], one row at a time (module docstring).

  Arrays with a batch axis (tokens, positions [B, T], query_weights [B, Q, T], the bias's [B, ...] or [L, B, ...]
  arrays, the cache's [L, B, S, K, H], the `DecoderCall`'s self-conditioning inputs, a compute policy's
  `ComputeSubset` — queries [B, T], keys [L, B, m], a reuse's cached outputs [L, B, S, D], the key-block call's full
  [B], so that each row takes its own branch; with query buckets each row runs at its own) are split by row; a bias
  array broadcast over the batch (size 1) is shared. The other arguments (config, the statistics spec, the readout,
  the attention path, the cache offset) are the same for every row. Returns the `ForwardOutput` of the whole batch:
  logits and hidden states joined on axis 0, every statistic on its batch axis 1 (`STATISTICS` layouts are [L', B,
  ...]), captures on axis 0 (the hooks' batch-bearing arrays are split by row like the others).
  """
  bias, query_weights, hooks = instruments.bias, instruments.query_weights, instruments.hooks
  cache, decoder, subset = compute.cache, compute.decoder, compute.subset
  rows: dict[str, Any] = {"tokens": _split(tokens, 0), "positions": _split(positions, 0)}
  if query_weights is not None:
    rows["query_weights"] = _split(query_weights, 0)
  if decoder is not None:
    rows["decoder"] = jax.tree.map(lambda a: _split(a, 0), decoder)
  shared_bias = {}
  for name, axis in _bias_axes(bias).items():
    x = getattr(bias, name)
    if x is not None and x.shape[axis] != 1:
      rows["bias_" + name] = _split(x, axis)
    else:
      shared_bias[name] = x
  if cache is not None:
    rows["cache"] = jax.tree.map(lambda a: _split(a, 1), cache)
  if subset is not None:
    refresh = subset.refresh
    if refresh is not None:
      refresh = refresh.replace(hidden=_split(refresh.hidden, 1), tracked=_split(refresh.tracked, 0),
                                start=_split(refresh.start, 0), tokens=_split(refresh.tokens, 0),
                                positions=_split(refresh.positions, 0))
    rows["subset"] = ComputeSubset(None if subset.queries is None else _split(subset.queries, 0),
                                   None if subset.keys is None else _split(subset.keys, 1), refresh=refresh,
                                   key_blocks=None if subset.key_blocks is None else jax.tree.map(
                                       lambda a: _split(a, 1), subset.key_blocks),
                                   reuse=jax.tree.map(lambda a: _split(a, 1), subset.reuse),
                                   full=None if subset.full is None else _split(subset.full, 0),
                                   buckets=subset.buckets)
  rebuild_hooks = None
  if hooks is not None:
    rows["hooks"], rebuild_hooks = row_slices(hooks)

  def one_row(row, shared_bias):
    row_bias = bias.replace(**shared_bias, **{name: row["bias_" + name] for name in _bias_axes(bias)
                                              if "bias_" + name in row})
    row_instruments = instruments.replace(
        bias=row_bias, query_weights=row.get("query_weights"),
        hooks=None if rebuild_hooks is None else rebuild_hooks(row["hooks"]))
    row_compute = compute.replace(cache=row.get("cache"), decoder=row.get("decoder"), subset=row.get("subset"))
    return forward(params, row["tokens"], config=config, positions=row["positions"], instruments=row_instruments,
                   readout=readout, compute=row_compute)

  out = _map_rows(one_row, rows, shared_bias)
  join = lambda x, axis: None if x is None else _join(x, axis)  # noqa: E731
  return ForwardOutput(logits=join(out.logits, 0), hidden=join(out.hidden, 0),
                       stats={name: _join(x, 1) for name, x in out.stats.items()},
                       captures=jax.tree.map(lambda x: _join(x, 0), out.captures),
                       cache=None if out.cache is None else jax.tree.map(lambda a: _join(a, 1), out.cache),
                       refresh=None if out.refresh is None else out.refresh.replace(
                           hidden=_join(out.refresh.hidden, 1), start=_join(out.refresh.start, 0),
                           similarity=_join(out.refresh.similarity, 1)))


def lm_head_rows(head, hidden: jax.Array) -> jax.Array:
  """head(hidden) for hidden [B, W, D], one row at a time: [B, W, V]."""
  return _join(_map_rows(lambda row, _: head(row), _split(hidden, 0)), 0)
