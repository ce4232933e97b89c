"""A run's output directory and its resumable results log.

`RunDir` checks the directory before any model work (it must be a directory or not exist yet, be
writable, and hold either nothing, or a `run.json` whose settings equal this run's) and creates it only
when the first result is written (`ensure`): a run that fails before its first result leaves nothing.
`run.json` holds the settings that change results (the binary's settings dataclass through
`dataclasses.asdict`, plus the identity of each checkpoint); resuming with other settings is refused
with the differing fields named. `--overwrite` replaces an existing run, again only at the first write.

`ResultsLog` is the JSONL of finished items: one JSON object per line, appended with flush + fsync,
keyed by a tuple of fields; on start the existing lines are read (a torn last line from a crash is cut
off) and finished keys are skipped, never duplicated. Only the primary process writes; every process
reads the log to skip the same work, so a multi-host run needs the directory on a shared filesystem.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from typing import Any

from absl import logging

from experiments.common import atomic_files, cli
from experiments.common.cli import UserError

RUN_FILE = "run.json"


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
  """{dotted.name: leaf} of nested dicts (lists are leaves)."""
  if isinstance(value, dict):
    out = {}
    for key, item in value.items():
      out.update(_flatten(item, f"{prefix}{key}."))
    return out
  return {prefix[:-1]: value}


def differing_fields(stored: dict[str, Any], current: dict[str, Any]) -> list[str]:
  """Dotted names of the settings that differ between two run.json dicts."""
  a, b = _flatten(stored), _flatten(current)
  return sorted(k for k in set(a) | set(b) if a.get(k, "<absent>") != b.get(k, "<absent>"))


def check_output_file(path: str, flag: str) -> None:
  """Refuses an output file path that is a directory or whose parent is a file (before any work)."""
  path = os.path.abspath(path)
  if os.path.isdir(path):
    raise UserError(f"--{flag}={path} is a directory; expected a file path")
  parent = os.path.dirname(path)
  while parent and not os.path.exists(parent):
    parent = os.path.dirname(parent)
  if parent and not os.path.isdir(parent):
    raise UserError(f"--{flag}={path}: {parent} is a file, not a directory")
  if parent and not os.access(parent, os.W_OK):
    raise UserError(f"--{flag}={path}: {parent} is not writable")


class RunDir:
  """An output directory checked now and created at the first result (module docstring).

  Attributes:
    path: absolute directory path.
    settings: the JSON-normalised run.json content of this run.
    primary: this process writes (the others only read).
    overwrite: replace an existing run at the first write.
    resumed: the directory already holds a run with these settings (its results are reused).
  """

  def __init__(self, path: str, settings: dict[str, Any], *, overwrite: bool = False, primary: bool = True):
    self.path = os.path.abspath(path)
    self.settings = json.loads(atomic_files.to_json(settings))
    self.primary, self.overwrite = primary, overwrite
    self.created = False
    self.resumed = False
    self._check()
    cli.set_resume_hint(f"the results finished so far are kept in {path}; run the same command again to resume")

  def _check(self) -> None:
    if os.path.exists(self.path) and not os.path.isdir(self.path):
      raise UserError(f"--output_dir={self.path} is a file; expected a directory (or a path that does not exist)")
    check_output_file(os.path.join(self.path, RUN_FILE), "output_dir")
    if not os.path.isdir(self.path) or self.overwrite:
      return
    run_file = os.path.join(self.path, RUN_FILE)
    if not os.path.exists(run_file):
      if os.listdir(self.path):
        raise UserError(f"--output_dir={self.path} holds files but no {RUN_FILE}; use an empty or new "
                        "directory, or --overwrite to replace its contents")
      return
    try:
      with open(run_file, encoding="utf-8") as f:
        stored = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
      raise UserError(f"{run_file} is unreadable ({e}); use another --output_dir or --overwrite") from None
    changed = differing_fields(stored, self.settings)
    if changed:
      raise UserError(f"{self.path} holds results of a run with other settings ({', '.join(changed)}); resume "
                      "with the same flags, use another --output_dir, or --overwrite to start again")
    self.resumed = True
    self.created = True

  def file(self, name: str) -> str:
    """Absolute path of `name` inside the directory (not created)."""
    return os.path.join(self.path, name)

  def ensure(self) -> None:
    """Creates the directory and writes run.json (replacing an old run with --overwrite); idempotent."""
    if self.created or not self.primary:
      self.created = True
      return
    if self.overwrite and os.path.isdir(self.path):
      shutil.rmtree(self.path)
    os.makedirs(self.path, exist_ok=True)
    atomic_files.write_json(self.file(RUN_FILE), self.settings)
    self.created = True

  def write_npz(self, name: str, **arrays: Any) -> None:
    """An .npz result file (creates the run first)."""
    self.ensure()
    if self.primary:
      atomic_files.write_npz(self.file(name), **arrays)


class ItemBudget(Exception):
  """Raised when --max_items_this_run lines have been written (a clean, resumable stop)."""


class ResultsLog:
  """Append-only JSONL of finished items in a `RunDir`, resumable (module docstring).

  key_fields: the record fields that identify an item (e.g. ("model", "top_k", "item")).
  budget: stop (ItemBudget) after this many lines written by this process; 0 = no limit.
  """

  def __init__(self, run_dir: RunDir, name: str, key_fields: Sequence[str], budget: int = 0):
    self.run_dir = run_dir
    self.path = run_dir.file(name)
    self.key_fields = tuple(key_fields)
    self.budget = budget
    self.written_this_run = 0
    self.records: list[dict[str, Any]] = []
    self._keys: set[tuple] = set()
    if run_dir.resumed:
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
    if good_end < len(data) and self.run_dir.primary:
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

  def append(self, record: dict[str, Any]) -> bool:
    """Appends one finished item; returns False (and writes nothing) when its key is already there.
    Raises ItemBudget when this process has written `budget` lines."""
    key = self.key(record)
    if key in self._keys:
      return False
    self.run_dir.ensure()
    self._keys.add(key)
    self.records.append(record)
    if self.run_dir.primary:
      line = (atomic_files.to_json(record) + "\n").encode("utf-8")
      with open(self.path, "ab") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())
    self.written_this_run += 1
    if self.budget and self.written_this_run >= self.budget:
      raise ItemBudget(f"wrote {self.written_this_run} result lines (--max_items_this_run); run again to resume")
    return True
