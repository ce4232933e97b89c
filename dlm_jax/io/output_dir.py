"""Output directories written whole or not at all, never into, over or above their inputs.

`atomic_output_dir` yields a fresh hidden temporary directory next to the target and renames it over the
target only when the body succeeded. The rules, checked before anything is written:

* Links are resolved first (`os.path.realpath`). A symlinked output path is written through: the link is
  kept and its target directory is replaced atomically (a temporary directory next to the target, then
  renamed over it), so the link points at the new output.
* The output may not be a source, a parent of a source, or inside a source directory (`sources`): replacing
  it would delete the input, and writing into it would change the input.
* An existing non-empty output is an error unless `overwrite`.
* An output whose parent cannot be written (read-only, not a directory, no permission) is a `CheckpointError`
  naming the path, and nothing is left behind.

Temporary work is named `.{name}.tmp-{host}-{pid}-{random}` (the output being built) and
`.{name}.old-{host}-{pid}-{random}` (the previous output between the two renames). A finished run leaves
neither; a killed run's leftovers are removed by the next run on the same output (`clean_stale`), once the
process that made them (same host, that pid) is gone.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import uuid
from collections.abc import Iterator, Sequence

from absl import logging

from dlm_jax.io.errors import CheckpointError


def _umask() -> int:
  mask = os.umask(0)
  os.umask(mask)
  return mask


def _inside(path: str, directory: str) -> bool:
  """True when real path `path` is `directory` or below it."""
  return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)


def check_not_over_sources(out_dir: str | os.PathLike, sources: Sequence[str | os.PathLike]) -> None:
  """Raises CheckpointError when the real `out_dir` is a source, holds one, or lies inside a source directory."""
  out = os.path.realpath(os.fspath(out_dir))
  for source in sources:
    src = os.path.realpath(os.fspath(source))
    if _inside(src, out):
      what = "is" if src == out else "contains"
      raise CheckpointError(f"Output directory {out_dir} {what} the input {source}"
                           f"{'' if os.fspath(source) == src else f' ({src})'}; writing there would destroy it. "
                           "Choose an output directory outside the input.")
    if os.path.isdir(src) and _inside(out, src):
      raise CheckpointError(f"Output directory {out_dir} is inside the input directory {source}; nothing is written "
                           "into an input. Choose an output directory outside it.")


def check_output_dir(out_dir: str | os.PathLike, *, overwrite: bool = False,
                     sources: Sequence[str | os.PathLike] = ()) -> None:
  """Raises CheckpointError if `out_dir` is blank, or the real `out_dir` is a file, a non-empty directory without
  `overwrite`, or overlaps a source (module docstring)."""
  if not os.fspath(out_dir).strip():
    raise CheckpointError(f"Output directory {os.fspath(out_dir)!r} is blank; expected a directory path.")
  check_not_over_sources(out_dir, sources)
  out = os.path.realpath(os.fspath(out_dir))
  if os.path.lexists(out):
    if not os.path.isdir(out):
      raise CheckpointError(f"Output path {out_dir} exists and is not a directory.")
    if os.listdir(out) and not overwrite:
      raise CheckpointError(f"Output directory {out_dir} is not empty; pass --overwrite (overwrite=True) to "
                           "replace it, or choose another directory.")


def _host() -> str:
  return socket.gethostname().replace("-", "_") or "host"


def _alive(pid: int) -> bool:
  """True unless no process has id `pid` (one owned by another user counts as alive)."""
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    pass
  return True


def remove(path: str) -> None:
  """Removes a file, a link or a directory tree."""
  if os.path.isdir(path) and not os.path.islink(path):
    shutil.rmtree(path)
  else:
    os.remove(path)


def clean_stale(out_dir: str | os.PathLike) -> list[str]:
  """Removes the temporary directories a killed run on `out_dir` left next to it (this host, dead pid);
  returns their paths."""
  out = os.path.realpath(os.fspath(out_dir))
  parent, base = os.path.split(out)
  if not os.path.isdir(parent):
    return []
  removed = []
  for name in sorted(os.listdir(parent)):
    for kind in ("tmp", "old"):
      prefix = f".{base}.{kind}-"
      if not name.startswith(prefix):
        continue
      parts = name[len(prefix):].split("-")
      if len(parts) != 3 or parts[0] != _host() or not parts[1].isdigit() or _alive(int(parts[1])):
        continue
      path = os.path.join(parent, name)
      remove(path)
      logging.info("Removed %s, left by an interrupted run.", path)
      removed.append(path)
  return removed


def _remove_old(path: str) -> None:
  """Removes the previous output after the swap; a failure is a warning (the next run removes it)."""
  try:
    shutil.rmtree(path)
  except OSError as e:
    logging.warning("Could not remove the previous output %s (%s); the next run on this output removes it.", path, e)


@contextlib.contextmanager
def atomic_output_dir(out_dir: str | os.PathLike, *, overwrite: bool = False,
                      sources: Sequence[str | os.PathLike] = ()) -> Iterator[str]:
  """Yields a fresh temporary directory and renames it to the real `out_dir` on success (module docstring).

  On any exception the temporary directory is removed and `out_dir` is left as it was. Every check
  (`check_output_dir`) happens before anything is written.
  """
  check_output_dir(out_dir, overwrite=overwrite, sources=sources)
  out = os.path.realpath(os.fspath(out_dir))
  parent, base = os.path.split(out)
  tag = f"{_host()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
  tmp = os.path.join(parent, f".{base}.tmp-{tag}")
  try:
    os.makedirs(parent, exist_ok=True)
    clean_stale(out)
    os.mkdir(tmp, 0o777 & ~_umask())
  except OSError as e:
    raise CheckpointError(f"Output directory {out_dir} cannot be created: {e.strerror or e} ({e.filename or parent}); "
                          "choose a directory you can write to.") from None
  try:
    yield tmp
    if os.path.lexists(out):
      old = os.path.join(parent, f".{base}.old-{tag}")
      os.rename(out, old)
      os.rename(tmp, out)
      _remove_old(old)
    else:
      os.rename(tmp, out)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
