"""Work directories of sandboxed runs: removed after a run, and, when their evaluator died, at the
next process's first run (never while their evaluator still holds them)."""

import os
import tempfile
import time

from dlm_jax.tasks import sandbox_workdir


def test_stale_work_directories_are_removed_and_live_ones_kept(tmp_path, monkeypatch):
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
  live, lock = sandbox_workdir.create()
  stale, fresh = tmp_path / "dlm-sandbox-dead", tmp_path / "dlm-sandbox-new"
  other = tmp_path / "unrelated"
  for path in (stale, fresh, other):
    (path / "locked").mkdir(parents=True)
    (path / "locked" / "file").write_text("x")
    (path / "locked").chmod(0)
  outside = tmp_path / "outside"
  outside.mkdir()
  (outside / "kept").write_text("x")
  outside.chmod(0o500)
  (stale / "link").symlink_to(outside, target_is_directory=True)
  an_hour_ago = time.time() - 3600
  for path in (live, stale, other):
    os.utime(path, (an_hour_ago, an_hour_ago))
  assert sandbox_workdir.remove_stale() == [str(stale)]
  assert os.path.isdir(live) and fresh.is_dir() and other.is_dir() and not stale.exists()
  assert (outside / "kept").read_text() == "x" and (outside.stat().st_mode & 0o777) == 0o500
  sandbox_workdir.remove(live, lock)
  assert not os.path.exists(live)
  for path in (fresh, other):
    (path / "locked").chmod(0o700)
  outside.chmod(0o700)
