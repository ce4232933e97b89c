"""A conversion plan: which source tensor fills which part of which output tensor, checked, then streamed.

A `Piece` says "source tensor S (shape as stored, e.g. torch [out, in]) becomes layer l of our stacked
tensor T, transposed or not". The plan is validated against the source's names, shapes and dtypes
before anything is written. `stream_pieces` then copies it a block of source rows at a time: rows
r0..r1 of a non-transposed source are rows r0..r1 of the output; for a transposed one they are columns
r0..r1 of the output, written row segment by row segment. Resident memory is one block (`chunk_bytes`)
plus its cast/transposed copy, independent of the tensor sizes.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

from dlm_jax.io.checkpoint import FLOAT_DTYPES, CheckpointError, SafetensorsWriter, describe_names

DEFAULT_CHUNK_BYTES = 64 * 1024**2


@dataclasses.dataclass(frozen=True)
class Piece:
  """Source tensor `source` (stored shape `shape`) -> output tensor `target`.

  layer: index on the stacked leading [L] axis of `target`, or None when `target` is not stacked.
  transpose: the source is a torch Linear weight [out, in] and the target a kernel [in, out].
  expert: with `layer`, the index on the target's second, [E] axis (one expert of a stacked MoE tensor).
  rows: (start, stop), the piece is only these rows of the source (one of q/k/v of a fused projection);
    None takes all of them.
  optional: the source may be absent; the piece then fills its part of `target` with zeros (a buffer
    that the original model initialises to zeros, e.g. an expert bias).
  split: (start, stop) — only rows start..stop-1 of the source's second-to-last axis are taken (one half of
    a fused expert `gate_up_proj` [E, 2F, D]); None takes all.
  swap_last: the last two axes of the (split) source are swapped (stacked expert weights [E, out, in] ->
    kernels [E, in, out]). Pieces with `split` or `swap_last` are read whole, not streamed by rows.
  """

  target: str
  source: str
  shape: tuple[int, ...]
  layer: int | None = None
  transpose: bool = False
  expert: int | None = None
  rows: tuple[int, int] | None = None
  optional: bool = False
  split: tuple[int, int] | None = None
  swap_last: bool = False

  @property
  def index(self) -> tuple[int, ...]:
    """The leading index prefix of the part of `target` this piece fills."""
    return tuple(i for i in (self.layer, self.expert) if i is not None)

  @property
  def fill_shape(self) -> tuple[int, ...]:
    """The shape of the part of `target` this piece fills (rows taken, split, swapped, transposed)."""
    shape = list(self.shape if self.rows is None else (self.rows[1] - self.rows[0],) + tuple(self.shape[1:]))
    if self.split is not None:
      shape[-2] = self.split[1] - self.split[0]
    if self.swap_last:
      shape[-2], shape[-1] = shape[-1], shape[-2]
    return tuple(reversed(shape)) if self.transpose else tuple(shape)

  @property
  def whole(self) -> bool:
    """True when the piece is read as one array (split or swapped expert tensors)."""
    return self.split is not None or self.swap_last


def check_plan(pieces: Sequence[Piece], found: Mapping[str, tuple[int, ...]], dtypes: Mapping[str, str] | None,
               where: str, ignore: str | None = None) -> None:
  """Checks that the source tensors are exactly the plan's, with the planned shapes and float dtypes.

  Args:
    pieces: the plan.
    found: {source name: stored shape}.
    dtypes: {source name: safetensors dtype string}, or None to skip the dtype check.
    where: the checkpoint, for messages.
    ignore: regex of source names that may be present and are not converted (e.g. rotary buffers).
  """
  planned = {p.source: p for p in pieces if not (p.optional and p.source not in found)}
  present = {n for n in found if not (ignore and re.fullmatch(ignore, n))}
  missing, unexpected = set(planned) - present, present - set(planned)
  if missing:
    raise CheckpointError(f"{where}: missing tensors {describe_names(missing)}; config.json implies them.")
  if unexpected:
    raise CheckpointError(f"{where}: unexpected tensors {describe_names(unexpected)}; nothing in the model "
                          "described by config.json takes them.")
  for name in sorted(planned):
    if tuple(found[name]) != planned[name].shape:
      raise CheckpointError(f"{where}: tensor {name} has shape {list(found[name])}; expected "
                            f"{list(planned[name].shape)} from config.json.")
    if dtypes is not None and dtypes[name] not in FLOAT_DTYPES:
      raise CheckpointError(f"{where}: tensor {name} has dtype {dtypes[name]}; expected a floating dtype "
                            f"({', '.join(FLOAT_DTYPES)}).")


def check_coverage(pieces: Iterable[Piece], expected: Mapping[str, tuple[int, ...]]) -> None:
  """Internal consistency: every output tensor is planned, each index (layer, or layer and expert) exactly
  once, shapes agree."""
  indices: dict[str, list[tuple[int, ...]]] = {}
  for p in pieces:
    shape = expected[p.target][len(p.index):]
    if p.fill_shape != tuple(shape):
      raise AssertionError(f"plan: {p.source} {p.shape} cannot fill {p.target} {expected[p.target]}")
    indices.setdefault(p.target, []).append(p.index)
  for name, shape in expected.items():
    found = sorted(indices.get(name, []))
    depth = len(found[0]) if found else 0
    if found != sorted(itertools.product(*(range(d) for d in shape[:depth]))):
      raise AssertionError(f"plan: output tensor {name} is not covered exactly once")


def stream_pieces(pieces: Sequence[Piece], read_rows: Callable[[str, int, int], np.ndarray],
                  writer: SafetensorsWriter, out_dtype: np.dtype, *, row_bytes: Callable[[str], int],
                  chunk_bytes: int = DEFAULT_CHUNK_BYTES, progress: Callable[[str], None] | None = None,
                  absent: frozenset[str] = frozenset()) -> None:
  """Copies every piece into `writer`, one block of source rows at a time, casting to `out_dtype`.

  Args:
    pieces: the (checked) plan; pieces of one target are processed together, targets in plan order.
    read_rows: (source name, start, stop) -> rows [start, stop) of the source as a numpy array.
    writer: an open `SafetensorsWriter` whose tensors are the plan's targets.
    out_dtype: dtype written.
    row_bytes: bytes of one leading-axis row of a source (sets the block size).
    chunk_bytes: target size of one block.
    progress: called with one line per finished output tensor.
    absent: sources of optional pieces that the checkpoint does not have; their parts are written as zeros.
  """
  targets: dict[str, list[Piece]] = {}
  for p in pieces:
    targets.setdefault(p.target, []).append(p)
  for k, (target, group) in enumerate(targets.items()):
    start = time.perf_counter()
    for p in group:
      if p.optional and p.source in absent:
        zeros = np.zeros(((1,) if p.index else ()) + p.fill_shape, out_dtype)
        writer.write(target, zeros, p.index)
        continue
      if p.whole:
        block = read_rows(p.source, 0, p.shape[0])
        if p.split is not None:
          block = block[..., p.split[0]:p.split[1], :]
        if p.swap_last:
          block = np.swapaxes(block, -1, -2)
        block = np.ascontiguousarray(block.astype(out_dtype, copy=False))
        writer.write(target, block[None] if p.index else block, p.index)
        del block
        continue
      first, rows = (0, p.shape[0]) if p.rows is None else (p.rows[0], p.rows[1] - p.rows[0])
      step = max(1, chunk_bytes // max(1, row_bytes(p.source)))
      prefix = p.index
      for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        block = read_rows(p.source, first + r0, first + r1).astype(out_dtype, copy=False)
        if p.transpose:
          writer.write_columns(target, block.T, prefix, r0)
        else:
          writer.write(target, block, prefix + (r0,))
        del block
    if progress is not None:
      shape = writer.tensors[target][0]
      size = math.prod(shape) * np.dtype(out_dtype).itemsize
      progress(f"[{k + 1}/{len(targets)}] {target} {list(shape)} {np.dtype(out_dtype).name} "
               f"({size / 1e6:.1f} MB) in {time.perf_counter() - start:.1f}s")
