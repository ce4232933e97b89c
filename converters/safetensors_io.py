"""Reading a Hugging Face safetensors checkpoint tensor by tensor, a block of rows at a time.

The headers are parsed and validated here (so a truncated or corrupted file is reported with its name
and the tensor concerned before anything is converted), and tensor data is read with `os.preadv` into a
fresh numpy buffer. Nothing is memory-mapped, so the converter's resident memory is only the block
being converted, whatever the checkpoint size.
"""

from __future__ import annotations

import dataclasses
import math
import os

import numpy as np

from dlm_jax.io import json_files
from dlm_jax.io.checkpoint import INDEX_FILE, SAFETENSORS_DTYPES, SINGLE_FILE, CheckpointError, check_shard_name

_MAX_HEADER_BYTES = 100 * 1024**2


@dataclasses.dataclass(frozen=True)
class TensorInfo:
  """One tensor of a safetensors file: shape, dtype string ("BF16", ...) and absolute byte range."""

  file: str
  dtype: str
  shape: tuple[int, ...]
  begin: int
  end: int

  @property
  def row_bytes(self) -> int:
    """Bytes of one leading-axis row (the whole tensor for a scalar)."""
    return math.prod(self.shape[1:]) * SAFETENSORS_DTYPES[self.dtype].itemsize


def _int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def read_header(path: str) -> dict[str, TensorInfo]:
  """{name: TensorInfo} of a safetensors file; CheckpointError if the file is truncated or malformed: a
  header that is not a UTF-8 JSON object, a name given twice, an entry without a known dtype, an integer shape
  and [begin, end] offsets, a byte range that does not match dtype × shape, lies outside the file or overlaps
  another tensor's (the checks of the safetensors library, made here because this reader does not use it)."""
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    prefix = f.read(8)
    if len(prefix) < 8:
      raise CheckpointError(f"{path} is truncated: {size} bytes, shorter than the 8-byte safetensors header "
                            "length.")
    n = int.from_bytes(prefix, "little")
    if n > min(size - 8, _MAX_HEADER_BYTES):
      raise CheckpointError(f"{path} is truncated or not a safetensors file: its header claims {n} bytes but the "
                            f"file has {size}.")
    raw = f.read(n)
  header = json_files.parse_json(raw, f"{path} is corrupted: its safetensors header", CheckpointError)
  data_start, data_size = 8 + n, size - 8 - n
  infos = {}
  for name, entry in header.items():
    if name == "__metadata__":
      continue
    try:
      dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
      ok = dtype in SAFETENSORS_DTYPES and all(_int(d) and d >= 0 for d in shape) and _int(begin) and _int(end)
    except (KeyError, TypeError, ValueError):
      ok = False
    if not ok:
      raise CheckpointError(f"{path} is corrupted: header entry for tensor {name} is {entry!r}; expected "
                            f"dtype in {sorted(SAFETENSORS_DTYPES)}, a shape and data_offsets [begin, end].")
    nbytes = math.prod(shape) * SAFETENSORS_DTYPES[dtype].itemsize
    if end - begin != nbytes or begin < 0:
      raise CheckpointError(f"{path} is corrupted: tensor {name} ({dtype} {list(shape)}) needs {nbytes} bytes "
                            f"but its data_offsets are [{begin}, {end}].")
    if end > data_size:
      raise CheckpointError(f"{path} is truncated: tensor {name} ends at data byte {end} but the file holds "
                            f"{data_size} data bytes.")
    infos[name] = TensorInfo(path, dtype, shape, data_start + begin, data_start + end)
  ranges = sorted((info.begin, info.end, name) for name, info in infos.items() if info.end > info.begin)
  for (_, end_a, a), (begin_b, _, b) in zip(ranges, ranges[1:]):
    if begin_b < end_a:
      raise CheckpointError(f"{path} is corrupted: tensors {a} and {b} share bytes (data_offsets overlap); each "
                            "tensor must have its own byte range.")
  return infos


class SafetensorsCheckpoint:
  """The tensors of a checkpoint directory (model.safetensors.index.json or one model.safetensors).

  Use as a context manager (files are opened once and closed on exit).
  """

  def __init__(self, directory: str):
    self.directory = directory
    index_path = os.path.join(directory, INDEX_FILE)
    if os.path.isfile(index_path):
      files = self._files_from_index(index_path)
    elif os.path.isfile(os.path.join(directory, SINGLE_FILE)):
      files, self.weight_map = [SINGLE_FILE], None
    else:
      raise CheckpointError(f"{directory} has neither {INDEX_FILE} nor {SINGLE_FILE} (PyTorch .bin checkpoints "
                            "are not supported; save with safetensors).")
    self.tensors: dict[str, TensorInfo] = {}
    for file_name in files:
      for name, info in read_header(os.path.join(directory, file_name)).items():
        if name in self.tensors:
          raise CheckpointError(f"Tensor {name} appears in both {self.tensors[name].file} and {info.file}.")
        self.tensors[name] = info
    if self.weight_map is not None:
      for name, file_name in sorted(self.weight_map.items()):
        info = self.tensors.get(name)
        if info is None or os.path.basename(info.file) != file_name:
          raise CheckpointError(f"{index_path} places tensor {name} in {file_name}, but that file has no such "
                                "tensor.")
    self._fds: dict[str, int] = {}

  def _files_from_index(self, index_path: str) -> list[str]:
    weight_map = json_files.read_json(index_path, CheckpointError).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
      raise CheckpointError(f"{index_path} is not a valid index: expected a JSON object with a 'weight_map' of "
                            "tensor name -> file name.")
    for name, file_name in sorted(weight_map.items()):
      check_shard_name(self.directory, index_path, name, file_name, links_may_leave=True)
    self.weight_map = weight_map
    for name, file_name in sorted(weight_map.items()):
      if not os.path.isfile(os.path.join(self.directory, file_name)):
        raise CheckpointError(f"{index_path}: tensor {name} is in {file_name}, which does not exist in "
                              f"{self.directory}.")
    return sorted(set(weight_map.values()))

  def __enter__(self) -> SafetensorsCheckpoint:
    return self

  def __exit__(self, *exc) -> None:
    for fd in self._fds.values():
      os.close(fd)
    self._fds = {}

  def read_rows(self, name: str, start: int, stop: int) -> np.ndarray:
    """Rows [start, stop) of tensor `name` along its leading axis, as a new numpy array."""
    info = self.tensors[name]
    if info.file not in self._fds:
      self._fds[info.file] = os.open(info.file, os.O_RDONLY)
    out = np.empty((stop - start,) + info.shape[1:], SAFETENSORS_DTYPES[info.dtype])
    view = memoryview(out.reshape(-1).view(np.uint8))
    offset = info.begin + start * info.row_bytes
    while view.nbytes:
      n = os.preadv(self._fds[info.file], [view], offset)
      if n == 0:
        raise CheckpointError(f"{info.file} is truncated: reading tensor {name} hit the end of the file.")
      view, offset = view[n:], offset + n
    return out

  def read(self, name: str) -> np.ndarray:
    """The whole tensor `name`."""
    shape = self.tensors[name].shape
    if not shape:
      return self.read_rows(name, 0, 1).reshape(())
    return self.read_rows(name, 0, shape[0])
