"""What a compute policy computed at each step of one generation, for the decoding explorer (`experiments.explore`):
the translation of a row's `Trace.computed_positions`, `Trace.keys_read` and `Trace.policy_record` into per-step
masks, one function per policy kind (`VIEWS`, by the policy's name), run by `experiments.sink_analysis` when it
keeps the figure item's arrays.

The masks (`step_view`'s arrays, saved in the item's .npz):
  policy            the policy the run decoded under, as text (`policy_text`)
  policy_computed   [T, S] bool, the positions whose queries the step computed (the others were read from the cache)
  policy_keys_read  [T] float32, the keys each computed query read (mean over layers; S at a full call)
  policy_keys       [T, L', H', S] bool (key-subset policies only): the keys the step's queries read at each
                    recorded layer; H' = 1 when every head reads the same keys, else N + 1 (head N: any head)
  policy_layers     [T, L, S] bool (per-layer policies only): per model layer, the positions recomputed
  policy_notes      [T] str, a line per step (what the record says beyond the masks)
T: the steps shown, L': the recorded layers (`layers`), L: the model's layers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from dlm_jax.policy.base import ComputePolicy


@dataclasses.dataclass(frozen=True)
class RowTrace:
  """One generation's policy entries of a `Trace` at the steps shown: computed [T, S] bool, keys_read [T] float32,
  record: `policy_record` at those steps for the row (None, an array [T, ...] or a dict of them); n_layers: the
  model's layers L."""

  computed: np.ndarray
  keys_read: np.ndarray
  record: Any
  n_layers: int


def policy_text(policy: ComputePolicy) -> str:
  """NAME, or NAME:knob=value,... for the knobs that differ from the policy's defaults (`parse_policy` reads it)."""
  knobs = [f"{f.name}={getattr(policy, f.name)}" for f in dataclasses.fields(policy)
           if f.init and f.name != "layout" and getattr(policy, f.name) != f.default]
  text = policy.NAME + (":" + ",".join(knobs) if knobs else "")
  return text.replace("=True", "=true").replace("=False", "=false")


def _positions_mask(index: np.ndarray, size: int) -> np.ndarray:
  """[..., size] bool, True at the entries of index [..., m] below size (entries >= size are padding)."""
  out = np.zeros(index.shape[:-1] + (size + 1,), bool)
  np.put_along_axis(out, np.minimum(index, size).astype(np.int64), True, axis=-1)
  return out[..., :size]


def _full(row: RowTrace) -> np.ndarray:
  """[T] bool: the step computed every position's query."""
  return row.computed.all(-1)


def _queries_only(policy: ComputePolicy, row: RowTrace, layers: list[int]) -> dict[str, np.ndarray]:
  """A policy without a view of its own: the computed positions; no key subset, no layer record."""
  del policy, layers
  return {"policy_notes": np.asarray(["full call" if f else "cached call" for f in _full(row)])}


def _dkv_cache(policy: ComputePolicy, row: RowTrace, layers: list[int]) -> dict[str, np.ndarray]:
  """dKV-Cache: the computed positions; no key subset, no layer record; record {"rows"} [T]: the query rows a
  cached call ran (its bucket, padding included)."""
  del policy, layers
  rows = np.asarray(row.record["rows"])
  return {"policy_notes": np.asarray(["full call" if f else f"cached call, {int(r)} row{'' if r == 1 else 's'} ran"
                                      for f, r in zip(_full(row), rows)])}


def _sparse_dllm(policy: ComputePolicy, row: RowTrace, layers: list[int]) -> dict[str, np.ndarray]:
  """Sparse-dLLM: record [T, L, m] each layer's kept keys (S: none). A full call reads every key; a subset call's
  queries read their layer's kept keys and each other (the record changes only at a block's step 1, a full call,
  so the record after a subset call is the set it read)."""
  del policy
  n = row.computed.shape[-1]
  kept = _positions_mask(np.asarray(row.record)[:, layers], n) | row.computed[:, None, :]  # [T, L', S]
  keys = np.where(_full(row)[:, None, None], True, kept)[:, :, None, :]
  notes = ["full call" if f else f"the block's {int(c.sum())} queries over each layer's kept keys"
           for f, c in zip(_full(row), row.computed)]
  return {"policy_keys": keys, "policy_notes": np.asarray(notes)}


def _sparsed(policy: ComputePolicy, row: RowTrace, layers: list[int]) -> dict[str, np.ndarray]:
  """SparseD: record [T, L, N, nQb, m] each layer's, head's and query block's kept key blocks (nKb: none). A full
  call (every step through the selection step) reads every key (keys_read S); later calls read the blocks chosen
  at the selection step. Per head: the positions of the blocks any of its query blocks kept; head N: any head."""
  n = row.computed.shape[-1]
  record = np.asarray(row.record)[:, layers]  # [T, L', N, nQb, m]
  n_blocks = -(-n // policy.block_size)
  blocks = _positions_mask(record.reshape(record.shape[:3] + (-1,)), n_blocks)  # [T, L', N, nKb]
  per_head = np.repeat(blocks, policy.block_size, axis=-1)[..., :n]
  keys = np.concatenate([per_head, per_head.any(2, keepdims=True)], axis=2)
  full = row.keys_read >= n
  keys = np.where(full[:, None, None, None], True, keys)
  return {"policy_keys": keys, "policy_notes": np.asarray(["dense call" if f else "block-sparse call" for f in full])}


def _dllm_cache(policy: ComputePolicy, row: RowTrace, layers: list[int]) -> dict[str, np.ndarray]:
  """dLLM-Cache: record [T, L, S] bool, per layer the positions whose Q, K, attention and feed-forward outputs the
  call recomputed (every residual stream runs: `computed` marks every position)."""
  del policy, layers
  recomputed = np.asarray(row.record, bool)
  notes = ["recomputed per layer: " + " / ".join(str(int(c)) for c in counts) for counts in recomputed.sum(-1)]
  return {"policy_layers": recomputed, "policy_notes": np.asarray(notes)}


def _elastic_cache(policy: ComputePolicy, row: RowTrace, layers: list[int]) -> dict[str, np.ndarray]:
  """Elastic-Cache: record {"refresh_start": [T], "queries": [T, n]}: the layers from refresh_start on recomputed
  every position, the layers below it the call's queries (padded with S); a full call recomputed everything."""
  del policy, layers
  n = row.computed.shape[-1]
  start = np.asarray(row.record["refresh_start"])
  queries = _positions_mask(np.asarray(row.record["queries"]), n)  # [T, S]
  return {"policy_layers": _refresh_layers(start, queries, _full(row), row.n_layers),
          "policy_notes": np.asarray(["full call" if f else f"every position from layer {int(s)} on" if s < row.n_layers
                                      else "no layer refreshed" for f, s in zip(_full(row), start)])}


def _refresh_layers(start: np.ndarray, queries: np.ndarray, full: np.ndarray, n_layers: int) -> np.ndarray:
  """[T, L, S] bool: every position at layers >= start[t] (and at a full call), queries[t] below."""
  above = np.arange(n_layers)[None, :] >= start[:, None]  # [T, L]
  return above[:, :, None] | full[:, None, None] | queries[:, None, :]


def _d2cache(policy: ComputePolicy, row: RowTrace, layers: list[int]) -> dict[str, np.ndarray]:
  """d2Cache: record {"count", "overflow", "rows"} [T]: the official query count, whether it did not fit the
  query budget, the query rows the call ran (its bucket, padding included)."""
  del policy, layers
  record = {k: np.asarray(v) for k, v in row.record.items()}
  notes = ["full call" if f else f"official query count {int(c)}, {int(r)} rows ran" + (" (overflow)" if o else "")
           for f, c, r, o in zip(_full(row), record["count"], record["rows"], record["overflow"])]
  return {"policy_notes": np.asarray(notes)}


VIEWS: dict[str, Callable[[ComputePolicy, RowTrace, list[int]], dict[str, np.ndarray]]] = {
    "dkv_cache": _dkv_cache, "sparse_dllm": _sparse_dllm, "sparsed": _sparsed, "dllm_cache": _dllm_cache,
    "elastic_cache": _elastic_cache, "d2cache": _d2cache}
"""The view of each policy kind: (policy, row, recorded layers) -> its masks beyond the computed positions."""


def step_view(policy: ComputePolicy, row: RowTrace, layers: list[int]) -> dict[str, np.ndarray]:
  """The arrays of the module docstring for one generation decoded under `policy` (the policy as it ran)."""
  view = VIEWS.get(policy.NAME, _queries_only)
  return {"policy": np.asarray(policy_text(policy)), "policy_computed": np.asarray(row.computed, bool),
          "policy_keys_read": np.asarray(row.keys_read, np.float32), **view(policy, row, layers)}
