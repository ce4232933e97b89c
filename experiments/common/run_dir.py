"""A run's output directory and its resumable results log.

`RunDir` checks the directory before any model work (it must be a directory or not exist yet, be
writable, and hold either nothing, or a `run.json` whose settings equal this run's) and creates it only
when the first result is written (`ensure`): a run that fails before its first result leaves nothing.
`run.json` holds the settings that change results (the binary's settings dataclass through
`dataclasses.asdict`, plus the identity of each checkpoint); resuming with other settings is refused
with the differing fields named. `--overwrite` replaces an existing run, again only at the first write.

The writing process holds an exclusive lock (`fcntl.flock` on `LOCK_FILE` inside the directory) from the
moment it resumes or replaces a run (or, for a new run, from its first result) until it exits; a second
process on the same directory is refused in one line instead of computing and appending the same items.
The lock is per process: several `RunDir`s of one process on one directory share it.

`ResultsLog` is the JSONL of finished items: one JSON object per line, appended with flush + fsync,
keyed by a tuple of fields; on start the existing lines are validated line by line
(`experiments.common.results_file`: only a torn last line from a crash is cut off, any other bad line is an error
naming the line and nothing is deleted) and finished keys are skipped, never duplicated. Only the primary
process writes; every process reads the log to skip the same work, so a multi-host run needs the directory
on a shared filesystem.

A run.json written before weights were identified by content (their sizes under "weights") cannot vouch
for the weights; resuming it is refused with a message saying so.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Sequence
from typing import Any

from absl import logging

from dlm_jax.io import json_files, output_dir
from experiments.common import atomic_files, results_file
from experiments.common.cli import UserError
from experiments.common import cli

RUN_FILE = "run.json"
LOCK_FILE = ".run.lock"
_LOCKS: dict[str, int] = {}
"""{real directory path: open lock file descriptor} held by this process."""


def lock(directory: str) -> None:
  """Takes this process's exclusive lock on `directory` (which exists); a one-line UserError when another
  process holds it. Held until the process exits."""
  real = os.path.realpath(directory)
  if real in _LOCKS:
    return
  fd = os.open(os.path.join(real, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o666)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    os.close(fd)
    raise UserError(f"--output_dir={directory} is in use by another process (it holds {LOCK_FILE} locked); wait for "
                    "it to finish, or use another --output_dir") from None
  _LOCKS[real] = fd


def inputs_of(models: Sequence[Any], task: str) -> list[str]:
  """The paths a run reads: its models' checkpoint directories and a task file (`RunDir`'s `inputs`)."""
  return [m.directory for m in models] + ([task] if os.path.isfile(task) else [])


def _old_weight_identity(stored: dict[str, Any], changed: list[str]) -> bool:
  """True when the stored run identifies checkpoint weights by size (before content hashes)."""
  flat = _flatten(stored)
  return any(".weights." in f".{key}." and isinstance(flat.get(key), int) for key in changed)


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
  """Refuses an output file path that is blank, a directory, or whose parent is a file or not writable (before any
  work)."""
  if not path.strip():
    raise UserError(f"--{flag}={path!r} is blank; expected a file path")
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
  `inputs` are the paths the run reads (checkpoint directories, task files): the directory may not be one of
  them, hold one (--overwrite would delete it) or lie inside one (links resolved).
  """

  def __init__(self, path: str, settings: dict[str, Any], *, overwrite: bool = False, primary: bool = True,
               inputs: Sequence[str] = ()):
    self.path = os.path.abspath(path)
    self.settings = json.loads(atomic_files.to_json(settings))
    self.primary, self.overwrite = primary, overwrite
    self.created = False
    self.resumed = False
    output_dir.check_not_over_sources(self.path, inputs)
    self._check()
    cli.set_resume_hint(f"the results finished so far are kept in {path}; run the same command again to resume")

  def _check(self) -> None:
    if os.path.exists(self.path) and not os.path.isdir(self.path):
      raise UserError(f"--output_dir={self.path} is a file; expected a directory (or a path that does not exist)")
    check_output_file(os.path.join(self.path, RUN_FILE), "output_dir")
    if not os.path.isdir(self.path):
      return
    if self.overwrite:
      if self.primary:
        lock(self.path)
      return
    run_file = os.path.join(self.path, RUN_FILE)
    if not os.path.exists(run_file):
      if set(os.listdir(self.path)) - {LOCK_FILE}:
        raise UserError(f"--output_dir={self.path} holds files but no {RUN_FILE}; use an empty or new "
                        "directory, or --overwrite to replace its contents")
      return
    stored = json_files.read_json(run_file, UserError)
    changed = differing_fields(stored, self.settings)
    if changed and _old_weight_identity(stored, changed):
      raise UserError(f"{run_file} identifies the checkpoint weights by file size (written by an older dlm_jax), so "
                      "its results cannot be shown to come from these weights; use --overwrite to start again, or "
                      "another --output_dir")
    if changed:
      raise UserError(f"{self.path} holds results of a run with other settings ({', '.join(changed)}); resume "
                      "with the same flags, use another --output_dir, or --overwrite to start again")
    if self.primary:
      lock(self.path)
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
    os.makedirs(self.path, exist_ok=True)
    lock(self.path)
    if self.overwrite:
      for name in sorted(set(os.listdir(self.path)) - {LOCK_FILE}):
        output_dir.remove(self.file(name))
    elif os.path.exists(self.file(RUN_FILE)):
      raise UserError(f"another process started a run in --output_dir={self.path} while this one was computing; "
                      "run again to resume it")
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
    contents = results_file.read(self.path, self.key_fields)
    for record in contents.records:
      key = self.key(record)
      if key not in self._keys:
        self._keys.add(key)
        self.records.append(record)
    if not self.run_dir.primary:
      return
    if contents.torn_bytes:
      logging.warning("%s: dropping a torn last line (%d bytes) left by an interrupted run.", self.path,
                      contents.torn_bytes)
      with open(self.path, "r+b") as f:
        f.truncate(contents.good_end)
        f.flush()
        os.fsync(f.fileno())
    elif contents.needs_newline:
      with open(self.path, "ab") as f:
        f.write(b"\n")
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
