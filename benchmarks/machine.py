"""The machine a benchmark ran on, as every benchmark prints and records it (flag-free, so any benchmark can import
it beside its own flags)."""

from __future__ import annotations

import os
import platform


def cpu_model() -> str:
  """The CPU's model name (/proc/cpuinfo) and logical CPU count."""
  name = platform.processor() or "unknown CPU"
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    name = names[0] if names else name
  except OSError:
    pass
  return f"{name} ({os.cpu_count()} logical CPUs)"
