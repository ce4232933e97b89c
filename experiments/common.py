"""Flags and helpers shared by the experiment binaries: model loading, resumable JSONL results, atomic
writes and progress lines. The runtime flags (--mesh, --distributed, --cpu_devices, ...) and placement
helpers live in `experiments.devices`, which this module imports, so every binary has them too.

Shared flags (every binary that imports this module has them):
  --output_dir           where results go (each binary has its own default under ./results/)
  --dtype                cast the weights (default: float32 on CPU, the stored dtype elsewhere)
  --max_items_this_run   stop cleanly after writing this many result lines (0 = no limit; simulates an
                         interruption, the next run resumes)

Resume protocol (`ResultsLog`): one JSON object per line, appended with flush + fsync, keyed by a tuple of
fields; on start the existing lines are read (a torn last line from a crash is cut off) and finished keys
are skipped, never duplicated. Final tables and figures are rebuilt from the log and written atomically
(temporary file + `os.replace`). Only the primary process (`dlm_jax.distributed.is_primary`) writes;
every process reads the log to skip the same work, so a multi-host run needs --output_dir on a shared
filesystem to resume.
A run directory remembers the settings that affect results (`run.json`); resuming with other settings is
refused (use a new --output_dir, or --overwrite to start again).
"""

from __future__ import annotations

import io
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags, logging

from experiments import devices

FLAGS = flags.FLAGS
flags.DEFINE_string("output_dir", None, "Results directory (default: results/<binary name>).")
flags.DEFINE_enum("dtype", None, ["float32", "bfloat16", "float16"],
                  "Weight dtype (default: float32 on CPU, the stored dtype on accelerators).")
flags.DEFINE_integer("max_items_this_run", 0, "Stop after writing this many result lines (0 = no limit).")
flags.DEFINE_bool("overwrite", False, "Delete an existing --output_dir first instead of resuming it.")


# ----------------------------------------------------------------------------------------------------------
# Weights.


def weight_dtype() -> Any:
  """--dtype, else float32 on CPU and None (stored dtype) on accelerators."""
  if FLAGS.dtype:
    return jnp.dtype(FLAGS.dtype)
  return jnp.float32 if jax.default_backend() == "cpu" else None


def load_params(directory: str, runtime: devices.Runtime, dtype: Any = None):
  """(config, params) of a converted directory, placed with `param_shardings` on the mesh if any."""
  from dlm_jax import checkpoint, model, sharding  # pylint: disable=import-outside-toplevel
  if runtime.mesh is None:
    return checkpoint.load(directory, dtype=dtype)
  config = checkpoint.read_config(directory)
  abstract = model.abstract_params(config, jnp.float32 if dtype is None else dtype)
  shardings = sharding.param_shardings(config, runtime.mesh, abstract)
  return checkpoint.load(directory, dtype=dtype, shardings=shardings)


def fixed_batches(n_items: int, batch_size: int) -> list[list[int]]:
  """Item indices in consecutive batches of `batch_size` (the last one shorter).

  The batches depend only on (n_items, batch_size), so a resumed run recomputes exactly the batches of
  an uninterrupted one (padded prompts and batch statistics stay the same)."""
  return [list(range(s, min(s + batch_size, n_items))) for s in range(0, n_items, batch_size)]


def pad_rows(array: np.ndarray, size: int) -> np.ndarray:
  """Pads the batch axis to `size` rows by repeating the last row (padding rows are discarded)."""
  array = np.asarray(array)
  if array.shape[0] >= size:
    return array
  return np.concatenate([array, np.repeat(array[-1:], size - array.shape[0], axis=0)], axis=0)


# ----------------------------------------------------------------------------------------------------------
# Output directory, atomic writes, resumable JSONL.


def output_dir(default_name: str) -> str:
  """--output_dir, or results/<default_name> under the working directory."""
  return os.path.abspath(FLAGS.output_dir or os.path.join("results", default_name))


def prepare_output_dir(path: str, runtime: devices.Runtime, settings: dict[str, Any]) -> None:
  """Creates `path` (emptied first with --overwrite) and checks or stores run.json = `settings`."""
  if not runtime.primary:
    return
  if FLAGS.overwrite and os.path.isdir(path):
    shutil.rmtree(path)
  os.makedirs(path, exist_ok=True)
  run_file = os.path.join(path, "run.json")
  normalised = json.loads(json.dumps(settings, sort_keys=True))
  if os.path.exists(run_file):
    with open(run_file, encoding="utf-8") as f:
      stored = json.load(f)
    if stored != normalised:
      changed = sorted(k for k in set(stored) | set(normalised) if stored.get(k) != normalised.get(k))
      raise SystemExit(f"{path} holds results of a run with other settings ({', '.join(changed)}); use another "
                       "--output_dir, or --overwrite to start again.")
    return
  write_json(run_file, normalised)


def atomic_write_bytes(path: str, data: bytes) -> None:
  """Writes `data` to a temporary file next to `path`, fsyncs it and renames it over `path`."""
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix="-" + os.path.basename(path))
  try:
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)
    with os.fdopen(fd, "wb") as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


def write_text(path: str, text: str) -> None:
  atomic_write_bytes(path, text.encode("utf-8"))


def _json_default(value: Any) -> Any:
  if isinstance(value, np.generic):
    return value.item()
  if isinstance(value, np.ndarray):
    return value.tolist()
  raise TypeError(f"Not JSON serialisable: {type(value).__name__}")


def to_json(value: Any, indent: int | None = None) -> str:
  """json.dumps accepting numpy scalars/arrays; NaN and inf become null (strict JSON)."""

  def clean(v):
    if isinstance(v, dict):
      return {str(k): clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
      return [clean(x) for x in v]
    if isinstance(v, np.ndarray):
      return clean(v.tolist())
    if isinstance(v, np.generic):
      v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
      return None
    return v

  return json.dumps(clean(value), indent=indent, default=_json_default, allow_nan=False)


def write_json(path: str, value: Any) -> None:
  atomic_write_bytes(path, (to_json(value, indent=1) + "\n").encode("utf-8"))


def write_npz(path: str, **arrays: np.ndarray) -> None:
  buffer = io.BytesIO()
  np.savez_compressed(buffer, **arrays)
  atomic_write_bytes(path, buffer.getvalue())


def save_figure(figure: Any, path: str, dpi: int = 100) -> None:
  """Saves a matplotlib figure as PNG atomically and closes it."""
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  buffer = io.BytesIO()
  figure.savefig(buffer, format="png", dpi=dpi, bbox_inches="tight")
  plt.close(figure)
  atomic_write_bytes(path, buffer.getvalue())


class ItemBudget(Exception):
  """Raised when --max_items_this_run lines have been written (a clean, resumable stop)."""


class ResultsLog:
  """Append-only JSONL of finished items, resumable (module docstring).

  key_fields: the record fields that identify an item (e.g. ("model", "top_k", "item")).
  """

  def __init__(self, path: str, key_fields: Sequence[str], primary: bool = True, budget: int | None = None):
    self.path = path
    self.key_fields = tuple(key_fields)
    self.primary = primary
    self.budget = FLAGS.max_items_this_run if budget is None else budget
    self.written_this_run = 0
    self.records: list[dict[str, Any]] = []
    self._keys: set[tuple] = set()
    self._read()

  def _read(self) -> None:
    if not os.path.exists(self.path):
      return
    with open(self.path, "rb") as f:
      data = f.read()
    good_end = 0
    for line in data.splitlines(keepends=True):
      if not line.endswith(b"\n"):
        break
      try:
        record = json.loads(line)
      except json.JSONDecodeError:
        break
      good_end += len(line)
      key = self.key(record)
      if key not in self._keys:
        self._keys.add(key)
        self.records.append(record)
    if good_end < len(data) and self.primary:
      logging.warning("%s: dropping a torn last line (%d bytes) left by an interrupted run.", self.path,
                      len(data) - good_end)
      with open(self.path, "r+b") as f:
        f.truncate(good_end)
        f.flush()
        os.fsync(f.fileno())

  def key(self, record: dict[str, Any]) -> tuple:
    return tuple(record.get(k) for k in self.key_fields)

  def done(self, **fields: Any) -> bool:
    return tuple(fields.get(k) for k in self.key_fields) in self._keys

  def append(self, record: dict[str, Any]) -> None:
    """Appends one finished item (ignored if its key is already there); raises ItemBudget when
    --max_items_this_run lines have been written by this process."""
    key = self.key(record)
    if key in self._keys:
      return
    self._keys.add(key)
    self.records.append(record)
    if self.primary:
      line = (to_json(record) + "\n").encode("utf-8")
      with open(self.path, "ab") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())
    self.written_this_run += 1
    if self.budget and self.written_this_run >= self.budget:
      raise ItemBudget(f"wrote {self.written_this_run} result lines (--max_items_this_run); run again to resume")


# ----------------------------------------------------------------------------------------------------------
# Progress.


class Progress:
  """Progress lines: `label: done/total (rate, elapsed, eta)` after each unit of work."""

  def __init__(self, label: str, total: int, done: int = 0, log: Callable[[str], None] = logging.info):
    self.label, self.total, self.done = label, total, done
    self.start, self.start_done = time.time(), done
    self.log = log
    if done:
      self.log(f"{label}: resuming with {done}/{total} already done")

  def update(self, n: int = 1, note: str = "") -> None:
    self.done += n
    elapsed = time.time() - self.start
    rate = (self.done - self.start_done) / max(elapsed, 1e-9)
    eta = (self.total - self.done) / rate if rate > 0 else float("nan")
    self.log(f"{self.label}: {self.done}/{self.total} done, {elapsed:.0f}s elapsed, eta {eta:.0f}s"
             + (f" — {note}" if note else ""))


def summary_banner(path: str, text: str) -> None:
  """Prints the summary text and where the results are."""
  print(text)
  print(f"\nResults written to {path}")


def display_path(path: str) -> str:
  """`path` relative to the working directory when inside it, with the home directory as ~ otherwise."""
  path = os.path.abspath(path)
  cwd = os.getcwd()
  if path == cwd or path.startswith(cwd + os.sep):
    return os.path.relpath(path, cwd)
  home = os.path.expanduser("~")
  return "~" + path[len(home):] if path.startswith(home + os.sep) else path

