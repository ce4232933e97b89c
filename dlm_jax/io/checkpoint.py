"""Converted checkpoints: reading and writing safetensors directories, and orbax training state.

A converted directory holds
  config.json                       `ModelConfig.to_json()`
  model.safetensors                 one file, or
  model-0000k-of-0000n.safetensors  several shards plus model.safetensors.index.json ({"weight_map": ...})
  tokenizer files                   copied verbatim (`TOKENIZER_FILES`)
Tensor names are the dotted params-tree paths of `dlm_jax.model` (e.g. "blocks.attn.q.kernel"); block
tensors are stored stacked, [L, ...], in the layout the model uses (kernels [in, out]).

Writing streams: `SafetensorsWriter` knows every tensor's shape and dtype up front, so it writes each
shard's header first, preallocates the file, and then fills tensors (or any row range of them, e.g. one
layer of a stacked tensor) at their byte offsets with `os.pwrite`. Nothing is memory-mapped for writing,
so a writer's resident memory is only the block being written. Directories are written under a
temporary name next to the target and renamed at the end (`atomic_output_dir`), so a failure leaves
no partial output.

Reading (`load`) memory-maps the files with `safe_open(..., framework="numpy")` and builds each array
with `jax.make_array_from_callback`, so every device reads only its own slice of each tensor.

Training state goes through orbax (`save_train_state`, `restore_train_state`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from dlm_jax.io import finite, json_files
from dlm_jax import default_models
from dlm_jax import model as model_lib
from dlm_jax.config import ConfigError, ModelConfig
from dlm_jax.io.errors import CheckpointError
from dlm_jax.io.output_dir import atomic_output_dir

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
    "tokenizer.model", "added_tokens.json", "chat_template.jinja", "chat_template.json", "generation_config.json")
"""Files copied from a source checkpoint directory when present."""

SAFETENSORS_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U64": np.dtype(np.uint64),
    "U32": np.dtype(np.uint32), "U16": np.dtype(np.uint16), "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2)}
"""safetensors dtype strings -> numpy dtypes (bfloat16 and float8 through ml_dtypes)."""
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
"""dtypes accepted for model weights."""
_DTYPE_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


def dtype_name(dtype: Any) -> str:
  """numpy/jax dtype -> safetensors dtype string ("BF16", "F32", ...)."""
  return _DTYPE_NAMES[np.dtype(dtype)]


def describe_names(names: Any, limit: int = 8) -> str:
  """A short, sorted listing of tensor names for error messages."""
  names = sorted(names)
  shown = ", ".join(names[:limit])
  return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


# ---------------------------------------------------------------------------------------------------------
# The expected tensor set.


def expected_tensors(config: ModelConfig) -> dict[str, tuple[int, ...]]:
  """{dotted name: shape} of every parameter of `config`'s model (see the `dlm_jax.model` docstring)."""
  flat = model_lib.flatten_params(model_lib.abstract_params(config))
  return {name: tuple(leaf.shape) for name, leaf in flat.items()}


def check_tensor_set(expected: Mapping[str, tuple[int, ...]], found: Mapping[str, tuple[int, ...]],
                     where: str) -> None:
  """Raises CheckpointError unless `found` has exactly the names and shapes of `expected`."""
  missing, unexpected = set(expected) - set(found), set(found) - set(expected)
  if missing:
    raise CheckpointError(f"{where}: missing tensors {describe_names(missing)}; the config expects them.")
  if unexpected:
    raise CheckpointError(f"{where}: unexpected tensors {describe_names(unexpected)}; the config has no such "
                          "parameters.")
  for name in sorted(expected):
    if tuple(found[name]) != tuple(expected[name]):
      raise CheckpointError(f"{where}: tensor {name} has shape {list(found[name])}; expected "
                            f"{list(expected[name])} from config.json.")


# ---------------------------------------------------------------------------------------------------------
# Directory handling.


def copy_tokenizer_files(src_dir: str | os.PathLike, dst_dir: str | os.PathLike) -> list[str]:
  """Copies the `TOKENIZER_FILES` present in `src_dir` to `dst_dir`; returns the names copied."""
  copied = []
  for name in TOKENIZER_FILES:
    src = os.path.join(src_dir, name)
    if os.path.isfile(src):
      shutil.copyfile(src, os.path.join(dst_dir, name))
      copied.append(name)
  return copied


def write_config(directory: str | os.PathLike, config: ModelConfig) -> None:
  with open(os.path.join(directory, CONFIG_FILE), "w") as f:
    f.write(config.to_json() + "\n")


def read_config(directory: str | os.PathLike) -> ModelConfig:
  """The `ModelConfig` of a converted directory; errors name the file and the field."""
  path = os.path.join(directory, CONFIG_FILE)
  if not os.path.isfile(path):
    raise CheckpointError(f"{path} not found: a converted checkpoint directory needs a config.json "
                          "written by dlm_jax (run converters.convert first).")
  values = json_files.read_json(path, CheckpointError)
  try:
    return ModelConfig.from_dict(values)
  except (ConfigError, TypeError) as e:
    raise ConfigError(f"{path}: {e}") from None


# ---------------------------------------------------------------------------------------------------------
# Streaming writer.


def _pwrite_all(fd: int, data: np.ndarray, offset: int) -> None:
  view = memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
  while view.nbytes:
    n = os.pwrite(fd, view, offset)
    view, offset = view[n:], offset + n


class _Slot:
  """Where one tensor lives: file descriptor, absolute byte offset, shape, dtype, bytes written so far."""

  def __init__(self, fd: int, offset: int, shape: tuple[int, ...], dtype: np.dtype):
    self.fd, self.offset, self.shape, self.dtype = fd, offset, shape, dtype
    self.strides = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))  # in elements
    self.nbytes = math.prod(shape) * dtype.itemsize
    self.written = 0


class SafetensorsWriter:
  """Writes tensors of known shapes into safetensors shards, a block at a time.

  Use as a context manager: the shards are created (header written, file preallocated) on entry; `write`
  fills any leading-axis range of a tensor; on exit every tensor must have been written exactly once
  (byte count check), the index is written when there are several shards, and files are fsynced.

  Args:
    directory: where the files go (must exist).
    tensors: {name: (shape, dtype)} in the order to lay them out.
    max_shard_bytes: start a new shard before a tensor that would push the current one past this size
      (a tensor larger than the limit gets a shard of its own).
  """

  def __init__(self, directory: str | os.PathLike, tensors: Mapping[str, tuple[tuple[int, ...], Any]], *,
               max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES):
    self._directory = os.fspath(directory)
    self.tensors = {name: (tuple(int(d) for d in shape), np.dtype(dtype)) for name, (shape, dtype) in
                    tensors.items()}
    """{name: (shape, dtype)} of every tensor, in file order."""
    self._max_shard_bytes = max_shard_bytes
    self._slots: dict[str, _Slot] = {}
    self._fds: list[int] = []
    self.files: dict[str, str] = {}  # tensor name -> file name

  def _plan_shards(self) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name, (shape, dtype) in self.tensors.items():
      nbytes = math.prod(shape) * dtype.itemsize
      if shards[-1] and size + nbytes > self._max_shard_bytes:
        shards.append([])
        size = 0
      shards[-1].append(name)
      size += nbytes
    return shards

  def __enter__(self) -> SafetensorsWriter:
    shards = self._plan_shards()
    for k, names in enumerate(shards):
      file_name = SINGLE_FILE if len(shards) == 1 else f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
      header: dict[str, Any] = {"__metadata__": {"format": "dlm_jax"}}
      start = 0
      for name in names:
        shape, dtype = self.tensors[name]
        end = start + math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": dtype_name(dtype), "shape": list(shape), "data_offsets": [start, end]}
        start = end
      blob = json.dumps(header, separators=(",", ":")).encode()
      blob += b" " * (-len(blob) % 8)
      fd = os.open(os.path.join(self._directory, file_name), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o666)
      self._fds.append(fd)
      _pwrite_all(fd, np.frombuffer(len(blob).to_bytes(8, "little") + blob, np.uint8), 0)
      data_start = 8 + len(blob)
      os.ftruncate(fd, data_start + start)
      for name in names:
        shape, dtype = self.tensors[name]
        self._slots[name] = _Slot(fd, data_start + header[name]["data_offsets"][0], shape, dtype)
        self.files[name] = file_name
    return self

  def _slot(self, name: str, array: np.ndarray) -> _Slot:
    if name not in self._slots:
      raise CheckpointError(f"SafetensorsWriter: no tensor named {name}; known: {describe_names(self._slots)}.")
    slot = self._slots[name]
    if array.dtype != slot.dtype:
      raise CheckpointError(f"SafetensorsWriter: tensor {name} is {slot.dtype}, got a block of {array.dtype}.")
    return slot

  def write(self, name: str, array: np.ndarray, at: tuple[int, ...] = ()) -> None:
    """Writes `array` into tensor `name` at index prefix `at`.

    With at = (i0, ..., ik) the array fills tensor[i0, ..., i(k-1), ik : ik + n] and must have shape
    (n,) + shape[k+1:]; at = () writes the whole tensor. Example: one layer of a stacked [L, D, F]
    tensor is `write(name, w[None], at=(layer,))`, rows r0.. of that layer `write(name, rows, (layer, r0))`.
    """
    array = np.asarray(array)
    slot = self._slot(name, array)
    k = len(at)
    ok = k == 0 and array.shape == slot.shape
    if k:
      ok = (k <= len(slot.shape) and array.shape[1:] == slot.shape[k:] and array.ndim == len(slot.shape) - k + 1
            and all(0 <= i < d for i, d in zip(at[:-1], slot.shape)) and 0 <= at[-1]
            and at[-1] + array.shape[0] <= slot.shape[k - 1])
    if not ok:
      raise CheckpointError(f"SafetensorsWriter: block of shape {array.shape} at {at} does not fit tensor {name} "
                            f"of shape {slot.shape}.")
    element = sum(i * s for i, s in zip(at, slot.strides))
    _pwrite_all(slot.fd, array, slot.offset + element * slot.dtype.itemsize)
    slot.written += array.nbytes

  def write_columns(self, name: str, block: np.ndarray, at: tuple[int, ...], column: int) -> None:
    """Writes block [R, c] into the 2-D sub-tensor M = tensor[at] as M[:, column : column + c].

    This is how a transposed tensor is streamed: rows r0..r1 of a torch weight [out, in] are columns
    r0..r1 of our kernel [in, out], written row segment by row segment.
    """
    block = np.asarray(block)
    slot = self._slot(name, block)
    sub = slot.shape[len(at):]
    if (len(sub) != 2 or block.ndim != 2 or block.shape[0] != sub[0] or column < 0
        or column + block.shape[1] > sub[1] or not all(0 <= i < d for i, d in zip(at, slot.shape))):
      raise CheckpointError(f"SafetensorsWriter: column block {block.shape} at {at}, column {column} does not fit "
                            f"tensor {name} of shape {slot.shape}.")
    itemsize = slot.dtype.itemsize
    base = slot.offset + (sum(i * s for i, s in zip(at, slot.strides)) + column) * itemsize
    row_stride = sub[1] * itemsize
    block = np.ascontiguousarray(block)
    for r in range(block.shape[0]):
      _pwrite_all(slot.fd, block[r], base + r * row_stride)
    slot.written += block.nbytes

  def __exit__(self, exc_type, exc, tb) -> None:
    try:
      if exc_type is None:
        for name, slot in self._slots.items():
          if slot.written != slot.nbytes:
            raise CheckpointError(f"SafetensorsWriter: tensor {name} received {slot.written} bytes; expected "
                                  f"{slot.nbytes} (some blocks were never written or written twice).")
        for fd in self._fds:
          os.fsync(fd)
        if len(set(self.files.values())) > 1:
          total = sum(slot.nbytes for slot in self._slots.values())
          index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(self.files.items()))}
          with open(os.path.join(self._directory, INDEX_FILE), "w") as f:
            json.dump(index, f, indent=2)
    finally:
      for fd in self._fds:
        os.close(fd)
      self._fds = []


# ---------------------------------------------------------------------------------------------------------
# Loading.


def check_shard_name(directory: str | os.PathLike, index_path: str, name: str, file_name: str, *,
                     links_may_leave: bool = False) -> None:
  """Refuses an index entry whose file is not a relative path inside `directory`: empty, absolute, with a
  `..` component, or (unless `links_may_leave`, as in a Hugging Face cache snapshot whose files link to its
  blobs) a link whose real path leaves the directory."""
  parts = file_name.replace("\\", "/").split("/")
  real_dir = os.path.realpath(directory)
  real = os.path.realpath(os.path.join(directory, file_name))
  if (os.path.isabs(file_name) or ".." in parts or not file_name
      or not (links_may_leave or real.startswith(real_dir.rstrip(os.sep) + os.sep))):
    raise CheckpointError(f"{index_path}: tensor {name} is in {file_name!r}, outside the checkpoint directory "
                          f"{directory}; shards must be files inside it.")


def tensor_files(directory: str | os.PathLike) -> dict[str, str]:
  """{tensor name: file name} of a directory with model.safetensors.index.json or one model.safetensors.

  For a single file the names are read from its header.
  """
  index_path = os.path.join(directory, INDEX_FILE)
  if os.path.isfile(index_path):
    weight_map = json_files.read_json(index_path, CheckpointError).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
      raise CheckpointError(f"{index_path}: 'weight_map' must map tensor names to file names.")
    for name, file_name in sorted(weight_map.items()):
      check_shard_name(directory, index_path, name, file_name)
    for name, file_name in sorted(weight_map.items()):
      if not os.path.isfile(os.path.join(directory, file_name)):
        raise CheckpointError(f"{index_path}: tensor {name} is in {file_name}, which does not exist.")
    return dict(weight_map)
  path = os.path.join(directory, SINGLE_FILE)
  if not os.path.isfile(path):
    raise CheckpointError(f"{directory} has neither {SINGLE_FILE} nor {INDEX_FILE}.")
  check_shard_name(directory, directory, SINGLE_FILE, SINGLE_FILE)
  with _open_safetensors(path) as f:
    return {name: SINGLE_FILE for name in f.keys()}


@contextlib.contextmanager
def _open_safetensors(path: str) -> Iterator[Any]:
  try:
    handle = safe_open(path, framework="numpy")
  except SafetensorError as e:
    raise CheckpointError(f"Cannot read {path}: {e}. The file is truncated or corrupted, or not a safetensors "
                          "file; convert the checkpoint again.") from None
  with handle as f:
    yield f


def _flat_shardings(shardings: Any, names: Mapping[str, Any]) -> dict[str, jax.sharding.Sharding]:
  """Normalises `shardings` (None, one Sharding, {dotted name: Sharding}, or a nested dict) to a flat dict."""
  if shardings is None:
    return {}
  if isinstance(shardings, jax.sharding.Sharding):
    return {name: shardings for name in names}
  flat: dict[str, Any] = {}

  def visit(prefix: str, node: Any) -> None:
    if isinstance(node, Mapping):
      for key, child in node.items():
        visit(f"{prefix}.{key}" if prefix else str(key), child)
    elif node is not None:
      flat[prefix] = node

  visit("", shardings)
  unknown = set(flat) - set(names)
  if unknown:
    raise CheckpointError(f"shardings name tensors the checkpoint does not have: {describe_names(unknown)}.")
  for name, sharding in flat.items():
    if not isinstance(sharding, jax.sharding.Sharding):
      raise CheckpointError(f"shardings[{name!r}] must be a jax.sharding.Sharding, got {type(sharding).__name__}.")
  return flat


def load(directory: str | os.PathLike, *, dtype: Any = None, shardings: Any = None,
         check_finite: bool = True) -> tuple[ModelConfig, model_lib.Params]:
  """Loads a converted directory into (config, params).

  Args:
    directory: a directory written by `save` or the converters, or the name of an embedded default model
      (`dlm_jax.default_models.NAMES`, e.g. "tiny-dlm") when no directory of that name exists.
    dtype: cast every tensor to this dtype (e.g. jnp.float32); None keeps the stored dtypes.
    shardings: None (default device), one `jax.sharding.Sharding` for every tensor, or a dict of dotted
      tensor name -> Sharding (flat, or nested like the params tree); tensors not named go to the default
      device. Each device reads only its slice of the memory-mapped file.
    check_finite: refuse weights holding NaN or ±inf (checked on device after placement, after any cast:
      one reduction per tensor, `dlm_jax.io.finite`).

  Returns:
    The `ModelConfig` and the nested params dict matching `dlm_jax.model.abstract_params(config)`.

  Raises:
    CheckpointError: missing/unexpected tensors, wrong shapes or dtypes, unreadable files, non-finite
      weights (all named).
    ConfigError: config.json lacks a field or has an invalid value.
  """
  directory = os.fspath(directory)
  if directory in default_models.NAMES and not os.path.isdir(directory):
    directory = default_models.path(directory)
  config = read_config(directory)
  expected = expected_tensors(config)
  locations = tensor_files(directory)
  target_dtype = None if dtype is None else np.dtype(dtype)
  placement = _flat_shardings(shardings, expected)
  default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  flat = {}
  with contextlib.ExitStack() as stack:
    handles = {f: stack.enter_context(_open_safetensors(os.path.join(directory, f)))
               for f in sorted(set(locations.values()))}
    slices, shapes = {}, {}
    for name, file_name in locations.items():
      if name not in handles[file_name].keys():
        raise CheckpointError(f"{INDEX_FILE} places tensor {name} in {file_name}, but that file has no such tensor.")
      slices[name] = handles[file_name].get_slice(name)
      shapes[name] = tuple(slices[name].get_shape())
    check_tensor_set(expected, shapes, directory)
    for name in sorted(expected):
      stored = slices[name].get_dtype()
      if stored not in FLOAT_DTYPES:
        raise CheckpointError(f"{directory}: tensor {name} has dtype {stored}; expected a floating dtype "
                              f"({', '.join(FLOAT_DTYPES)}).")
    for name in sorted(expected):
      tensor = slices[name]

      def read(index, tensor=tensor):
        block = tensor[index]
        return block if target_dtype is None else block.astype(target_dtype, copy=False)

      out_dtype = target_dtype or SAFETENSORS_DTYPES[tensor.get_dtype()]
      flat[name] = jax.make_array_from_callback(shapes[name], placement.get(name, default), read, dtype=out_dtype)
  if check_finite:
    check_weights_finite(flat, config, directory)
  return config, model_lib.unflatten_params(flat)


def _absolute_layer(config: ModelConfig, name: str, index: int) -> int:
  """The model layer of entry `index` of the stacked tensor `name` (see the `dlm_jax.model` docstring)."""
  if config.layer_pattern is not None:
    letter = "g" if name.startswith("global_blocks.") else "s"
    return [l for l, kind in enumerate(config.layer_pattern) if kind == letter][index]
  if name.startswith("blocks.") and config.is_moe:
    return config.first_k_dense + index
  return index


def check_weights_finite(flat: Mapping[str, jax.Array], config: ModelConfig, where: str | os.PathLike) -> None:
  """Raises CheckpointError naming the first tensor (and layer, for stacked block tensors) holding NaN or inf."""
  bad = finite.first_nonfinite(flat)
  if bad:
    name, index = next(iter(bad.items()))
    axes = model_lib.PARAM_AXES.get(name, ())
    place = f" in layer {_absolute_layer(config, name, index)}" if axes and axes[0] == "layers" else ""
    more = f" ({len(bad) - 1} more tensors too)" if len(bad) > 1 else ""
    raise CheckpointError(f"{where}: tensor {name} holds non-finite values (NaN or inf){place}{more}; the weights are "
                          "corrupted (load with check_finite=False to inspect them).")


# ---------------------------------------------------------------------------------------------------------
# Saving.


def save(directory: str | os.PathLike, config: ModelConfig, params: model_lib.Params,
         tokenizer_dir: str | os.PathLike | None = None, *, overwrite: bool = False,
         max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
  """Writes (config, params) as a converted directory, atomically.

  Stacked block tensors are fetched to the host one layer at a time, so the host holds at most one
  layer slice (or one unstacked tensor) at once. Needs fully addressable arrays (single process).

  Args:
    directory: target directory; must be absent or empty unless `overwrite`.
    config: the model configuration (written as config.json).
    params: nested params dict matching `dlm_jax.model.abstract_params(config)` (any float dtype).
    tokenizer_dir: copy the tokenizer files found there (`TOKENIZER_FILES`).
    overwrite: replace a non-empty `directory`.
    max_shard_bytes: shard size limit (see `SafetensorsWriter`).
  """
  flat = model_lib.flatten_params(params)
  check_tensor_set(expected_tensors(config), {n: tuple(v.shape) for n, v in flat.items()}, "save(params)")
  specs = {name: (tuple(flat[name].shape), np.dtype(flat[name].dtype)) for name in sorted(flat)}
  sources = () if tokenizer_dir is None else (tokenizer_dir,)
  with atomic_output_dir(directory, overwrite=overwrite, sources=sources) as tmp:
    write_config(tmp, config)
    if tokenizer_dir is not None:
      copy_tokenizer_files(tokenizer_dir, tmp)
    with SafetensorsWriter(tmp, specs, max_shard_bytes=max_shard_bytes) as writer:
      for name, (shape, _) in specs.items():
        leaf = flat[name]
        if model_lib.PARAM_AXES[name][0] == "layers":
          for layer in range(shape[0]):
            writer.write(name, np.asarray(leaf[layer:layer + 1]), at=(layer,))
        else:
          writer.write(name, np.asarray(leaf))


# ---------------------------------------------------------------------------------------------------------
# Training state (orbax).


def train_state_manager(directory: str | os.PathLike, *, max_to_keep: int | None = 3) -> Any:
  """An `orbax.checkpoint.CheckpointManager` for step-indexed training state under `directory`."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top  (heavy; only training needs it)
  options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
  return ocp.CheckpointManager(os.path.abspath(os.fspath(directory)), options=options)


def save_train_state(directory: str | os.PathLike, step: int, state: Any, *, max_to_keep: int | None = 3) -> None:
  """Saves the pytree `state` (params, optimizer state, ...) as step `step`; blocks until written."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  manager = train_state_manager(directory, max_to_keep=max_to_keep)
  try:
    manager.save(step, args=ocp.args.StandardSave(state))
    manager.wait_until_finished()
  finally:
    manager.close()


def restore_train_state(directory: str | os.PathLike, abstract_state: Any, *,
                        step: int | None = None) -> tuple[int, Any]:
  """Restores (step, state) from `directory` (latest step unless `step`).

  `abstract_state` is a pytree of `jax.ShapeDtypeStruct` (with `sharding=` to restore sharded), e.g.
  `jax.eval_shape(make_state)`.
  """
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  manager = train_state_manager(directory)
  try:
    step = manager.latest_step() if step is None else step
    if step is None:
      raise CheckpointError(f"No training checkpoint under {directory}.")
    return step, manager.restore(step, args=ocp.args.StandardRestore(abstract_state))
  finally:
    manager.close()
