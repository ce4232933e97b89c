"""Progress lines of the long-running binaries and the closing banner."""

from __future__ import annotations

import logging as python_logging
import os
import time
from typing import Callable

from absl import logging


class Progress:
  """Progress lines `label: done/total done, elapsed, eta` after each unit of work.

  `update(n)` counts n finished units; callers pass the number of result lines actually written, so the
  count always matches the results file."""

  def __init__(self, label: str, total: int, done: int = 0, log: Callable[[str], None] = logging.info):
    self.label, self.total, self.done = label, total, done
    self.start, self.start_done = time.time(), done
    self.log = log
    if done:
      self.log(f"{label}: resuming with {done}/{total} already done")

  def update(self, n: int = 1, note: str = "") -> None:
    if not n:
      return
    self.done += n
    elapsed = time.time() - self.start
    rate = (self.done - self.start_done) / max(elapsed, 1e-9)
    eta = (self.total - self.done) / rate if rate > 0 else float("nan")
    self.log(f"{self.label}: {self.done}/{self.total} done, {elapsed:.0f}s elapsed, eta {eta:.0f}s"
             + (f" — {note}" if note else ""))


def quiet_orbax() -> None:
  """Drops orbax's INFO lines (they share absl's logger, one per checkpoint save) so that the progress lines
  of a binary that trains stay readable."""
  logging.get_absl_handler().addFilter(
      lambda record: record.levelno >= python_logging.WARNING or "orbax" not in record.pathname)


def summary_banner(path: str, text: str) -> None:
  """Prints the summary text and where the results are."""
  print(text)
  print(f"\nResults written to {display_path(path)}")


def display_path(path: str) -> str:
  """`path` relative to the working directory when inside it, with the home directory as ~ otherwise."""
  path = os.path.abspath(path)
  cwd = os.getcwd()
  if path == cwd or path.startswith(cwd + os.sep):
    return os.path.relpath(path, cwd)
  home = os.path.expanduser("~")
  return "~" + path[len(home):] if path.startswith(home + os.sep) else path
