"""SHA-256 of checkpoint weight files, cached so that a resumed run does not read the weights twice.

run.json identifies each checkpoint's weights by content (`experiments.common.checkpoints.identity`), so a results
file can never mix two models whose files merely have the same sizes. Hashing reads every byte once (about
1-2 GB/s on one core); the digest is then cached by real path, size, modification time (ns) and inode in
`$DLM_JAX_CACHE/weight_hashes.json` (default root `~/.cache/dlm_jax`, the same root as the SmolLM2
conversion), never inside the checkpoint directory: inputs are not written to. A file that changed in any
of those is hashed again. The cache is written atomically under a lock file; an unreadable cache is
ignored (and rebuilt) with a warning, since it only saves time.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os

from absl import logging

from experiments.common import atomic_files
from experiments.common.cli import UserError

CACHE_NAME = "weight_hashes.json"
_BLOCK = 8 * 2**20


def cache_path() -> str:
  """`$DLM_JAX_CACHE/weight_hashes.json`, default root `~/.cache/dlm_jax`."""
  root = os.environ.get("DLM_JAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "dlm_jax")
  return os.path.join(root, CACHE_NAME)


def _read_cache(path: str) -> dict[str, dict]:
  if not os.path.isfile(path):
    return {}
  try:
    with open(path, encoding="utf-8") as f:
      cache = json.load(f)
    if isinstance(cache, dict) and all(isinstance(v, dict) for v in cache.values()):
      return cache
  except (OSError, UnicodeDecodeError, json.JSONDecodeError):
    pass
  logging.warning("%s is not a valid weight-hash cache; it is rebuilt.", path)
  return {}


def _stamp(path: str) -> dict[str, int]:
  stat = os.stat(path)
  return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "inode": stat.st_ino}


def file_sha256(path: str) -> str:
  """The hex SHA-256 of the file at `path`, read in 8 MiB blocks."""
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    while block := f.read(_BLOCK):
      digest.update(block)
  return digest.hexdigest()


def sha256(paths: list[str]) -> dict[str, str]:
  """{path: hex SHA-256} of weight files, from the cache when a file's stamp is unchanged (module docstring).
  Without a writable cache directory every file is hashed (with a warning)."""
  cache_file = cache_path()
  try:
    os.makedirs(os.path.dirname(cache_file), exist_ok=True)
    lock = open(cache_file + ".lock", "w", encoding="utf-8")  # pylint: disable=consider-using-with
  except OSError as e:
    logging.warning("Weight hashes are not cached (%s); every run hashes the weights again.", e)
    return {path: file_sha256(path) for path in paths}
  with lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    cache = _read_cache(cache_file)
    out, changed = {}, False
    for path in paths:
      real = os.path.realpath(path)
      stamp = _stamp(real)
      entry = cache.get(real)
      if entry is None or {k: entry.get(k) for k in stamp} != stamp or not isinstance(entry.get("sha256"), str):
        entry = dict(stamp, sha256=file_sha256(real))
        if _stamp(real) != stamp:
          raise UserError(f"{path} changed while it was being hashed; run again once it is no longer being written")
        cache[real], changed = entry, True
      out[path] = entry["sha256"]
    if changed:
      atomic_files.write_json(cache_file, cache)
  return out
