"""Files written whole or not at all: the one atomic writer of the library and the binaries.

`write(path, fill)` calls fill(file) on a temporary file next to `path` (opened "wb"), fsyncs it and renames
it over `path` (`os.replace`), so a reader or a resumed run never sees a half-written file; on any failure
the temporary file is removed and the target is left as it was. The file gets the permissions an ordinary
`open` would give (0o666 less the umask), not `mkstemp`'s 0o600.
"""

from __future__ import annotations

import os
import tempfile
from typing import BinaryIO, Callable


def write(path: str | os.PathLike, fill: Callable[[BinaryIO], object]) -> None:
  """Writes `path` atomically: fill(f) writes the content into the binary file object f (module docstring).
  The parent directory is created if missing."""
  path = os.fspath(path)
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix="-" + os.path.basename(path))
  try:
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)
    with os.fdopen(fd, "wb") as f:
      fill(f)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise
