"""summary.json and summary.md, the two files an analysis binary's report ends with."""

from __future__ import annotations

import os
from typing import Any

from experiments.common import atomic_files


def write(out: str, summary: Any, lines: list[str]) -> str:
  """Writes `summary` to <out>/summary.json and the markdown `lines`, one per line, to <out>/summary.md;
  returns the markdown."""
  text = "\n".join(lines) + "\n"
  atomic_files.write_json(os.path.join(out, "summary.json"), summary)
  atomic_files.write_text(os.path.join(out, "summary.md"), text)
  return text
