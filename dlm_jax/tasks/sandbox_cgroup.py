"""A pids cgroup bounding how many processes a sandboxed run may have at once (see `sandbox`).

RLIMIT_NPROC counts processes per user and does not apply to root, so when the evaluator runs as root
the process limit comes from a cgroup instead: `create(limit)` makes a child of the evaluator's own
pids cgroup (cgroup v1 `pids` hierarchy, or v2 where the `pids` controller is enabled for children)
with `pids.max = limit`, the sandbox's supervisor moves itself into it before it forks (`join`), and
`remove` deletes it afterwards
(`remove_stale` deletes those an evaluator that died left behind). Where no such cgroup can be made (not root, no delegation) `create`
returns None and the rlimit is what there is.
"""

from __future__ import annotations

import os
import secrets
import time

_PREFIX = "dlm-sandbox-"
_STALE_S = 60.0


def create(limit: int) -> str | None:
  """A new pids cgroup directory allowing `limit` processes, or None where none can be made."""
  for parent in _pids_cgroups():
    path = os.path.join(parent, _PREFIX + secrets.token_hex(6))
    try:
      os.mkdir(path, 0o755)
    except OSError:
      continue
    try:
      with open(os.path.join(path, "pids.max"), "w", encoding="ascii") as f:
        f.write(str(limit))
      return path
    except OSError:
      os.rmdir(path)
  return None


def join(path: str) -> bool:
  """Moves the calling process into the cgroup at `path`; whether it worked."""
  try:
    with open(os.path.join(path, "cgroup.procs"), "w", encoding="ascii") as f:
      f.write("0")
    return True
  except OSError:
    return False


def remove(path: str, timeout_s: float = 2.0) -> None:
  """Deletes the cgroup once its last process has gone (killed processes can take a moment to leave)."""
  deadline = time.monotonic() + timeout_s
  while True:
    try:
      os.rmdir(path)
      return
    except FileNotFoundError:
      return
    except OSError:
      if time.monotonic() > deadline:
        raise
      time.sleep(0.01)


def remove_stale() -> None:
  """Deletes the empty run cgroups older than a minute (an evaluator that died left them behind)."""
  for parent in _pids_cgroups():
    try:
      names = os.listdir(parent)
    except OSError:
      continue
    for name in names:
      path = os.path.join(parent, name)
      try:
        if name.startswith(_PREFIX) and time.time() - os.stat(path).st_mtime > _STALE_S:
          os.rmdir(path)
      except OSError:
        pass


def _pids_cgroups() -> list[str]:
  """The directories of this process's pids cgroup in which a child with the controller can be made."""
  own, cgroups, mounts = {}, _read("/proc/self/cgroup"), _read("/proc/self/mountinfo")
  for line in cgroups.splitlines():
    _, controllers, path = line.split(":", 2)
    for controller in controllers.split(",") if controllers else [""]:
      own[controller] = path
  found = []
  for line in mounts.splitlines():
    fields = line.split()
    root, mount_point, fs_type = fields[3], fields[4], fields[fields.index("-") + 1]
    options = fields[-1].split(",")
    if fs_type == "cgroup" and "pids" in options and "pids" in own:
      found.append(mount_point + _below(own["pids"], root))
    elif fs_type == "cgroup2" and "" in own:
      directory = mount_point + _below(own[""], root)
      if "pids" in _read(os.path.join(directory, "cgroup.subtree_control")).split():
        found.append(directory)
  return found


def _below(path: str, root: str) -> str:
  """`path` (a cgroup) relative to a mount of the hierarchy that starts at `root`."""
  return path[len(root):] if root != "/" and path.startswith(root) else path


def _read(path: str) -> str:
  """The file's text, or "" where it cannot be read (no /proc, no such controller file)."""
  try:
    with open(path, encoding="utf-8") as f:
      return f.read()
  except OSError:
    return ""
