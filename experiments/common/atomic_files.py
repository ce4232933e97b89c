"""Files written whole or not at all: a temporary file next to the target, fsynced, then renamed over it
(`os.replace`), so a reader or a resumed run never sees a half-written table, figure or array."""

from __future__ import annotations

import io
import json
import math
from typing import Any

import numpy as np

from dlm_jax.io import atomic_write


def atomic_write_bytes(path: str, data: bytes) -> None:
  """Writes `data` to a temporary file next to `path`, fsyncs it and renames it over `path`
  (`dlm_jax.io.atomic_write`)."""
  atomic_write.write(path, lambda f: f.write(data))


def write_text(path: str, text: str) -> None:
  """Writes UTF-8 `text` atomically."""
  atomic_write_bytes(path, text.encode("utf-8"))


def _json_default(value: Any) -> Any:
  """numpy scalars and arrays as JSON values."""
  if isinstance(value, np.generic):
    return value.item()
  if isinstance(value, np.ndarray):
    return value.tolist()
  raise TypeError(f"Not JSON serialisable: {type(value).__name__}")


def to_json(value: Any, indent: int | None = None) -> str:
  """json.dumps accepting numpy scalars/arrays; NaN and inf become null (strict JSON)."""

  def clean(v):
    if isinstance(v, dict):
      return {str(k): clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
      return [clean(x) for x in v]
    if isinstance(v, np.ndarray):
      return clean(v.tolist())
    if isinstance(v, np.generic):
      v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
      return None
    return v

  return json.dumps(clean(value), indent=indent, default=_json_default, allow_nan=False)


def write_json(path: str, value: Any) -> None:
  """Writes `value` as indented strict JSON atomically."""
  atomic_write_bytes(path, (to_json(value, indent=1) + "\n").encode("utf-8"))


def write_npz(path: str, **arrays: np.ndarray) -> None:
  """Writes a compressed .npz of `arrays` atomically."""
  buffer = io.BytesIO()
  np.savez_compressed(buffer, **arrays)
  atomic_write_bytes(path, buffer.getvalue())


def save_figure(figure: Any, path: str, dpi: int = 100) -> None:
  """Saves a matplotlib figure as PNG atomically and closes it."""
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  buffer = io.BytesIO()
  figure.savefig(buffer, format="png", dpi=dpi, bbox_inches="tight")
  plt.close(figure)
  atomic_write_bytes(path, buffer.getvalue())
