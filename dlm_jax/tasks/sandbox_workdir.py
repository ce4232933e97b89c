"""The private work directory of a sandboxed run (see `sandbox`), and the cleanup of ones left behind.

`create()` makes `<tempdir>/dlm-sandbox-XXXX` (mode 0700) and holds an exclusive `flock` on it for
as long as the run lasts; `remove` deletes it whatever permissions the program left inside. A directory
left by an evaluator that died (SIGKILL, power loss) is found by `remove_stale()`: its lock is free
and it is more than a minute old (a directory just made, before its lock, is not touched).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import time

_PREFIX = "dlm-sandbox-"
_STALE_S = 60.0


def create() -> tuple[str, int]:
  """A new work directory and the descriptor holding its lock."""
  path = tempfile.mkdtemp(prefix=_PREFIX)
  fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
  fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  return path, fd


def remove(path: str, fd: int) -> None:
  """Deletes the work directory, then releases its lock."""
  try:
    _delete(path)
  finally:
    os.close(fd)


def remove_stale() -> list[str]:
  """Deletes the work directories of runs whose evaluator is gone; the paths deleted."""
  root, removed = tempfile.gettempdir(), []
  for name in os.listdir(root):
    path = os.path.join(root, name)
    if not name.startswith(_PREFIX) or os.path.islink(path) or not os.path.isdir(path):
      continue
    try:
      if time.time() - os.stat(path).st_mtime < _STALE_S:
        continue
      fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
      continue
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      _delete(path)
      removed.append(path)
    except OSError:
      pass
    finally:
      os.close(fd)
  return removed


def _delete(path: str) -> None:
  """rmtree; if permissions the program left stop it, makes every directory writable and retries.
  Directories are opened without following links, so nothing outside `path` is ever changed."""
  try:
    shutil.rmtree(path)
    return
  except PermissionError:
    pass
  _make_writable(path)
  for parent, dirs, _ in os.walk(path):
    for name in dirs:
      _make_writable(os.path.join(parent, name))
  shutil.rmtree(path)


def _make_writable(directory: str) -> None:
  try:
    fd = os.open(directory, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC)
  except OSError:  # a link, or gone
    return
  try:
    os.chmod(f"/proc/self/fd/{fd}", 0o700)
  finally:
    os.close(fd)
