"""Trajectory datasets: per-(item, step, position) rows of a sampler run on disk, readable with NumPy alone.

On disk a dataset is a directory:

  manifest.json                 what the dataset is (below), rewritten atomically after every shard
  shards/00000/<column>.npy     one plain NumPy .npy file per column and shard: [rows_in_shard, shape...]
  shards/00001/<column>.npy     ...

manifest.json (a JSON object):
  format: "dlm_jax.trajectory_dataset"; version: 1
  model: what identifies the model's weights by content (for the binaries: the SHA-256 of config.json and
    of every weight file, `experiments.common.checkpoints.identity`); compared whole by `expect_model`
  settings: the settings the rows were produced with (sites, steps, prompts, decoding, ...)
  columns: {name: {"dtype": NumPy dtype string ("<f4", "<i4", ...), "shape": per-row shape (list)}}
  expected_shards: the number of shards a finished export has
  shards: [{"rows": n, "files": {column: {"bytes": file size, "sha256": hex digest}}}, ...] in order
  complete: true once every shard is written
Column names are made of letters, digits, "_", "." and "-" (site names such as blocks.1.hook_resid_post).

Reading without dlm_jax (NumPy only):

  import json, numpy as np, os
  m = json.load(open(os.path.join(path, "manifest.json")))
  cols = {c: np.concatenate([np.load(os.path.join(path, "shards", f"{k:05d}", c + ".npy"), mmap_mode="r")
                             for k in range(len(m["shards"]))]) for c in m["columns"]}

and with Hugging Face `datasets` (one shard at a time, so memory stays bounded; multi-dimensional columns
become nested lists):

  import datasets
  parts = [datasets.Dataset.from_dict({c: np.load(os.path.join(path, "shards", f"{k:05d}", c + ".npy"))
                                       for c in m["columns"]}) for k in range(len(m["shards"]))]
  ds = datasets.concatenate_datasets(parts)

Writing (`TrajectoryWriter`): the writer is opened with the model identity, settings, columns and the number
of shards of the finished export; shard k is written whole (each column to a temporary file, fsynced, renamed)
and then listed in the manifest (atomic rename). A killed export leaves the manifest listing the shards that
were finished; reopening the writer with the same model, settings and columns resumes at the next shard,
deleting any unlisted leftover. A shard's bytes depend only on the arrays handed to `write_shard`, so an
exporter that builds shard k from the same items gives byte-identical shards after a resume. Memory: the
writer keeps nothing between shards.

Errors (`TrajectoryDatasetError`, one line naming the file and what was expected): a manifest that is not
one, a shard file missing or of another size or shape than the manifest says (torn), a dataset of another
model (`expect_model`) or settings, a column that does not exist.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from dlm_jax.io import atomic_write

FORMAT = "dlm_jax.trajectory_dataset"
VERSION = 1
MANIFEST = "manifest.json"
SHARDS = "shards"
_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


class TrajectoryDatasetError(ValueError):
  """A trajectory dataset that cannot be read or resumed; the message is one line naming the file."""


def shard_dir(path: str, index: int) -> str:
  """The directory of shard `index` of the dataset at `path`."""
  return os.path.join(path, SHARDS, f"{index:05d}")


def _column_spec(columns: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
  """{name: (dtype, shape)} or {name: {"dtype", "shape"}} -> the manifest's normalised column dict."""
  spec = {}
  for name, value in columns.items():
    if not isinstance(name, str) or not _NAME.match(name):
      raise TrajectoryDatasetError(f"column name {name!r}: expected letters, digits, '_', '.' or '-'")
    dtype, shape = (value["dtype"], value["shape"]) if isinstance(value, Mapping) else value
    spec[name] = {"dtype": np.dtype(dtype).str, "shape": [int(s) for s in shape]}
  if not spec:
    raise TrajectoryDatasetError("a trajectory dataset needs at least one column")
  return spec


class _HashingWriter:
  """A write-only file object that passes bytes on to `file` and counts and hashes them (SHA-256)."""

  def __init__(self, file):
    self.file, self.digest, self.size = file, hashlib.sha256(), 0

  def write(self, data) -> int:
    view = memoryview(data)
    view = view if view.format == "B" and view.ndim == 1 else view.cast("B")
    self.digest.update(view)
    self.size += len(view)
    return self.file.write(view)


def _write_npy(path: str, array: np.ndarray) -> dict[str, Any]:
  """Writes `array` as a version 1.0 .npy file (C order; the same array gives the same bytes) atomically;
  returns its {"bytes", "sha256"}. The array's memory goes through the hash into the file without a copy."""
  array = np.ascontiguousarray(array)
  out = {}

  def write(f):
    sink = _HashingWriter(f)
    np.lib.format.write_array_header_1_0(sink, np.lib.format.header_data_from_array_1_0(array))
    if array.size:
      sink.write(memoryview(array.reshape(-1)).cast("B"))
    out.update(bytes=sink.size, sha256=sink.digest.hexdigest())

  atomic_write.write(path, write)
  return out


def read_manifest(path: str) -> dict[str, Any]:
  """The checked manifest of the dataset directory `path` (TrajectoryDatasetError when it is not one)."""
  file = os.path.join(path, MANIFEST)
  if not os.path.isfile(file):
    raise TrajectoryDatasetError(f"{path} is not a trajectory dataset: no {MANIFEST}")
  try:
    with open(file, "rb") as f:
      manifest = json.loads(f.read().decode("utf-8"))
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise TrajectoryDatasetError(f"{file} is not a readable JSON manifest ({type(e).__name__}: {e})") from None
  found = manifest.get("format") if isinstance(manifest, dict) else manifest
  if found != FORMAT:
    raise TrajectoryDatasetError(f"{file}: expected format {FORMAT!r}, got {_short(found)}")
  if manifest.get("version") != VERSION:
    raise TrajectoryDatasetError(f"{file}: version {manifest.get('version')!r}; this dlm_jax reads version {VERSION}")
  for key, kind in (("model", dict), ("settings", dict), ("columns", dict), ("shards", list),
                    ("expected_shards", int), ("complete", bool)):
    if not isinstance(manifest.get(key), kind):
      raise TrajectoryDatasetError(f"{file}: field {key!r} is missing or not a {kind.__name__}")
  try:
    manifest["columns"] = _column_spec(manifest["columns"])
  except (KeyError, TypeError, ValueError) as e:
    raise TrajectoryDatasetError(f"{file}: bad columns ({e})") from None
  for k, shard in enumerate(manifest["shards"]):
    if (not isinstance(shard, dict) or not isinstance(shard.get("rows"), int) or
        not isinstance(shard.get("files"), dict) or set(shard["files"]) != set(manifest["columns"])):
      raise TrajectoryDatasetError(f"{file}: shard {k} must list rows and one file per column")
  return manifest


def _check_shard(path: str, manifest: dict[str, Any], index: int, verify: bool) -> None:
  """Raises TrajectoryDatasetError when shard `index`'s files are missing, torn or not what the manifest says."""
  shard = manifest["shards"][index]
  for name, spec in manifest["columns"].items():
    file = os.path.join(shard_dir(path, index), name + ".npy")
    want = shard["files"][name]
    if not os.path.isfile(file):
      raise TrajectoryDatasetError(f"{file} is missing; the manifest lists shard {index} as written")
    size = os.path.getsize(file)
    if size != want.get("bytes"):
      raise TrajectoryDatasetError(f"{file} is torn: {size} bytes, the manifest says {want.get('bytes')}")
    try:
      array = np.load(file, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as e:
      raise TrajectoryDatasetError(f"{file} is not a readable .npy file ({e})") from None
    expect = (shard["rows"], *spec["shape"])
    if array.shape != expect or array.dtype.str != spec["dtype"]:
      raise TrajectoryDatasetError(f"{file} holds {array.dtype.str} {list(array.shape)}; the manifest says "
                                   f"{spec['dtype']} {list(expect)}")
    if verify:
      with open(file, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
      if digest != want.get("sha256"):
        raise TrajectoryDatasetError(f"{file}: SHA-256 {digest[:12]}… differs from the manifest's "
                                     f"{str(want.get('sha256'))[:12]}…")


def _check_expected(manifest: dict[str, Any], file: str, model: Any, settings: Any, columns: Any) -> None:
  if model is not None and manifest["model"] != model:
    raise TrajectoryDatasetError(f"{file} was exported from another model (its weights identity differs: "
                                 f"{_difference(manifest['model'], model)}); expected {_short(model)}")
  if settings is not None and json.loads(json.dumps(settings)) != manifest["settings"]:
    raise TrajectoryDatasetError(f"{file} was exported with other settings "
                                 f"({_difference(manifest['settings'], settings)})")
  if columns is not None and _column_spec(columns) != manifest["columns"]:
    raise TrajectoryDatasetError(f"{file} has other columns "
                                 f"({_difference(manifest['columns'], _column_spec(columns))})")


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
  if isinstance(value, Mapping):
    out = {}
    for k, v in value.items():
      out.update(_flat(v, f"{prefix}{k}."))
    return out
  return {prefix[:-1]: value}


def _difference(stored: Any, wanted: Any) -> str:
  a, b = _flat(json.loads(json.dumps(stored))), _flat(json.loads(json.dumps(wanted)))
  keys = sorted(k for k in set(a) | set(b) if a.get(k, "<absent>") != b.get(k, "<absent>"))
  return ", ".join(keys[:4]) + (", …" if len(keys) > 4 else "")


def _short(value: Any) -> str:
  text = json.dumps(value, sort_keys=True)
  return text if len(text) <= 120 else text[:117] + "..."


class TrajectoryDataset:
  """A finished (or, with `allow_incomplete`, partly written) trajectory dataset opened for reading.

  manifest: the manifest dict; num_rows: rows over every shard; columns: the column names;
  column(name) -> [num_rows, shape...] (a read-only memory map with one shard; the shards' memory maps
  concatenated, i.e. read into memory, with several: use `shard_column` or `iter_batches` for bounded memory);
  shard_column(k, name) -> shard k's memory-mapped [rows_k, shape...]; iter_batches(...) -> dicts of batches.
  """

  def __init__(self, path: str, manifest: dict[str, Any]):
    self.path = path
    self.manifest = manifest
    self._rows = [int(s["rows"]) for s in manifest["shards"]]
    self._offsets = np.concatenate([[0], np.cumsum(self._rows, dtype=np.int64)])
    self._maps: dict[tuple[int, str], np.ndarray] = {}

  @property
  def num_rows(self) -> int:
    return int(self._offsets[-1])

  @property
  def columns(self) -> tuple[str, ...]:
    return tuple(self.manifest["columns"])

  @property
  def num_shards(self) -> int:
    return len(self._rows)

  def _name(self, name: str) -> str:
    if name not in self.manifest["columns"]:
      raise TrajectoryDatasetError(f"{self.path} has no column {name!r}; its columns are {', '.join(self.columns)}")
    return name

  def shard_column(self, index: int, name: str) -> np.ndarray:
    """Shard `index`'s column `name`, memory-mapped read-only: [rows_in_shard, shape...] (opened once)."""
    key = (index, self._name(name))
    if key not in self._maps:
      self._maps[key] = np.load(os.path.join(shard_dir(self.path, index), name + ".npy"), mmap_mode="r",
                                allow_pickle=False)
    return self._maps[key]

  def column(self, name: str) -> np.ndarray:
    """Column `name` over every shard: [num_rows, shape...] (class docstring on memory)."""
    self._name(name)
    if self.num_shards == 1:
      return self.shard_column(0, name)
    if self.num_shards == 0:
      spec = self.manifest["columns"][name]
      return np.zeros((0, *spec["shape"]), np.dtype(spec["dtype"]))
    return np.concatenate([self.shard_column(k, name) for k in range(self.num_shards)])

  def rows(self, columns: Sequence[str], indices: np.ndarray) -> dict[str, np.ndarray]:
    """The given global row indices (any order) of `columns`, read shard by shard: {name: [len, shape...]}."""
    indices = np.asarray(indices, np.int64)
    shard = np.searchsorted(self._offsets, indices, side="right") - 1
    out = {}
    for name in columns:
      spec = self.manifest["columns"][self._name(name)]
      values = np.empty((len(indices), *spec["shape"]), np.dtype(spec["dtype"]))
      for k in np.unique(shard):
        at = np.nonzero(shard == k)[0]
        local = indices[at] - self._offsets[k]
        order = np.argsort(local, kind="stable")
        values[at[order]] = self.shard_column(int(k), name)[local[order]]
      out[name] = values
    return out

  def column_view(self, name: str) -> "ColumnView":
    """Column `name` as a `ColumnView`: rows read on indexing, shard by shard (bounded memory)."""
    return ColumnView(self, self._name(name))

  def iter_batches(self, columns: Sequence[str], batch_size: int, shuffle_seed: int | None = None,
                   drop_last: bool = False) -> Iterator[dict[str, np.ndarray]]:
    """Batches of `batch_size` rows ({name: [batch, shape...]}), in order or in the permutation of
    `np.random.default_rng(shuffle_seed)`; the last batch is shorter unless `drop_last`. Only one batch is
    in memory at a time."""
    columns = [self._name(c) for c in columns]
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
      raise TrajectoryDatasetError(f"batch_size must be a positive integer, got {batch_size!r}")
    n = self.num_rows
    order = None if shuffle_seed is None else np.random.default_rng(shuffle_seed).permutation(n)
    for start in range(0, n, batch_size):
      stop = min(start + batch_size, n)
      if drop_last and stop - start < batch_size:
        return
      if order is None:
        yield self.rows(columns, np.arange(start, stop))
      else:
        yield self.rows(columns, order[start:stop])


class ColumnView:
  """One column of a dataset seen as an array [num_rows, shape...] without reading it: `shape`, `ndim`,
  `dtype`, and `view[indices]` for an integer index array (read shard by shard through `rows`), so code that
  indexes a NumPy array (e.g. `dlm_jax.training.sae_loop.ArrayBatches`) reads only the rows it asks for."""

  def __init__(self, dataset: TrajectoryDataset, name: str):
    spec = dataset.manifest["columns"][name]
    self.dataset, self.name = dataset, name
    self.shape = (dataset.num_rows, *spec["shape"])
    self.ndim = len(self.shape)
    self.dtype = np.dtype(spec["dtype"])

  def __getitem__(self, indices: Any) -> np.ndarray:
    return self.dataset.rows([self.name], np.asarray(indices, np.int64))[self.name]


def open_trajectory_dataset(path: str, *, expect_model: Any = None, verify: bool = False,
                            allow_incomplete: bool = False) -> TrajectoryDataset:
  """The dataset at `path`, its manifest and every listed shard checked (sizes, shapes, dtypes; with `verify`
  the SHA-256 too). expect_model: the model identity the rows must come from (None: any). An unfinished
  export is refused unless `allow_incomplete`. Raises TrajectoryDatasetError (one line)."""
  path = os.path.abspath(path)
  manifest = read_manifest(path)
  file = os.path.join(path, MANIFEST)
  _check_expected(manifest, file, expect_model, None, None)
  if not manifest["complete"] and not allow_incomplete:
    raise TrajectoryDatasetError(f"{path} is an unfinished export ({len(manifest['shards'])} of "
                                 f"{manifest['expected_shards']} shards); run the export again to finish it")
  for k in range(len(manifest["shards"])):
    _check_shard(path, manifest, k, verify)
  return TrajectoryDataset(path, manifest)


class TrajectoryWriter:
  """Writes (or resumes) a dataset shard by shard (module docstring).

  path: the dataset directory (created at the first shard); model, settings: JSON-able dicts recorded in the
  manifest and compared on resume; columns: {name: (dtype, per-row shape)}; expected_shards: the number of
  shards of the finished export. `shards_done` is where `write_shard` continues.
  """

  def __init__(self, path: str, *, model: dict[str, Any], settings: dict[str, Any], columns: Mapping[str, Any],
               expected_shards: int):
    self.path = os.path.abspath(path)
    if isinstance(expected_shards, bool) or not isinstance(expected_shards, int) or expected_shards < 1:
      raise TrajectoryDatasetError(f"expected_shards must be a positive integer, got {expected_shards!r}")
    self.manifest = {"format": FORMAT, "version": VERSION, "model": json.loads(json.dumps(model)),
                     "settings": json.loads(json.dumps(settings)), "columns": _column_spec(columns),
                     "expected_shards": expected_shards, "shards": [], "complete": False}
    if os.path.exists(self.path) and not os.path.isdir(self.path):
      raise TrajectoryDatasetError(f"{self.path} is a file; expected a dataset directory or a new path")
    if os.path.isfile(os.path.join(self.path, MANIFEST)):
      self._resume()
    elif os.path.isdir(self.path) and os.listdir(self.path):
      raise TrajectoryDatasetError(f"{self.path} holds files but no {MANIFEST}; use an empty or new directory")

  def _resume(self) -> None:
    stored = read_manifest(self.path)
    file = os.path.join(self.path, MANIFEST)
    _check_expected(stored, file, self.manifest["model"], self.manifest["settings"], self.manifest["columns"])
    if stored["expected_shards"] != self.manifest["expected_shards"]:
      raise TrajectoryDatasetError(f"{file} expects {stored['expected_shards']} shards; this export makes "
                                   f"{self.manifest['expected_shards']}")
    for k in range(len(stored["shards"])):
      _check_shard(self.path, stored, k, verify=False)
    self.manifest = stored
    self._remove_unlisted()

  def _remove_unlisted(self) -> None:
    """Deletes shard directories and temporary files a killed export left beyond the listed shards."""
    root = os.path.join(self.path, SHARDS)
    if os.path.isdir(root):
      for name in sorted(os.listdir(root)):
        if not (name.isdigit() and int(name) < len(self.manifest["shards"])):
          shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    for name in os.listdir(self.path):
      if name.startswith(".tmp-"):
        os.remove(os.path.join(self.path, name))

  @property
  def shards_done(self) -> int:
    return len(self.manifest["shards"])

  @property
  def complete(self) -> bool:
    return self.manifest["complete"]

  def write_shard(self, index: int, arrays: Mapping[str, np.ndarray]) -> None:
    """Writes shard `index` (must be `shards_done`): {column: [rows, shape...]} with the declared dtypes and
    shapes and one row count, then lists it in the manifest (the last shard marks the dataset complete)."""
    if index != self.shards_done:
      raise TrajectoryDatasetError(f"shard {index} written out of order; the next shard of {self.path} is "
                                   f"{self.shards_done}")
    if index >= self.manifest["expected_shards"]:
      raise TrajectoryDatasetError(f"{self.path} already has its {self.manifest['expected_shards']} shards")
    columns = self.manifest["columns"]
    if set(arrays) != set(columns):
      raise TrajectoryDatasetError(f"shard {index}: columns {sorted(arrays)} differ from the dataset's "
                                   f"{sorted(columns)}")
    rows = {int(np.shape(a)[0]) for a in arrays.values()}
    if len(rows) != 1:
      raise TrajectoryDatasetError(f"shard {index}: columns of different row counts {sorted(rows)}")
    directory = shard_dir(self.path, index)
    if os.path.isdir(directory):
      shutil.rmtree(directory)
    os.makedirs(directory)
    files = {}
    for name, spec in columns.items():
      array = np.asarray(arrays[name])
      if array.dtype.str != spec["dtype"] or list(array.shape[1:]) != spec["shape"]:
        raise TrajectoryDatasetError(f"shard {index}: column {name} is {array.dtype.str} {list(array.shape[1:])} per "
                                     f"row; the dataset declares {spec['dtype']} {spec['shape']}")
      files[name] = _write_npy(os.path.join(directory, name + ".npy"), array)
    self.manifest["shards"].append({"rows": rows.pop(), "files": files})
    self.manifest["complete"] = self.shards_done == self.manifest["expected_shards"]
    text = (json.dumps(self.manifest, indent=1) + "\n").encode("utf-8")
    atomic_write.write(os.path.join(self.path, MANIFEST), lambda f: f.write(text))
