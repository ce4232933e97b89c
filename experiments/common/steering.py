"""Steering files: activation additions applied while a sampler decodes, as a file a binary or the lm-eval model
reads (`steer=FILE`; lm-eval's own `steered` model uses the same idea for autoregressive models).

A steering file is a JSON object {site: entry} whose sites are full TransformerLens names
(`blocks.3.hook_resid_post`; `dlm_jax.instrument.sites`) and whose entries are objects with
  vector       the direction: a list of numbers of the site's feature shape, or the path of a .npy file
               (relative to the JSON file);
  coefficient  the multiplier (default 1);
  positions    the position class steered (default "masked": the still-unresolved positions, as the 2026
               steering papers do; `dlm_jax.instrument.hook_spec.POSITION_CLASSES`);
  steps        [start, stop): the sampler steps steered (default every step).
Each entry becomes `Edit(site, "add", positions=...)`: value + coefficient · vector at that site, layer,
class and step window, inside the compiled sampler.
"""

from __future__ import annotations

import json
import os

import numpy as np

from dlm_jax.config import ModelConfig
from dlm_jax.instrument import sites
from dlm_jax.instrument.hook_call import HookValues, hook_values
from dlm_jax.instrument.hook_spec import POSITION_CLASSES, Edit, Hooks
from experiments.common.cli import UserError

ENTRY_KEYS = ("vector", "coefficient", "positions", "steps")


def read(path: str) -> list[tuple[str, dict]]:
  """The file's entries [(site, entry)], checked for their form (not yet against a model); UserError names
  the file and the entry."""
  try:
    with open(path, encoding="utf-8") as f:
      spec = json.load(f)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise UserError(f"steering file {path}: cannot read it as JSON ({e})") from None
  if not isinstance(spec, dict) or not spec:
    raise UserError(f"steering file {path}: expected a non-empty JSON object {{site: entry}}")
  entries = []
  for site, entry in spec.items():
    where = f"steering file {path}, {site!r}"
    try:
      kind, layer = sites.parse(site)
      Edit(site, "add")
    except ValueError as e:
      raise UserError(f"{where}: {e}") from None
    if not isinstance(entry, dict) or "vector" not in entry or set(entry) - set(ENTRY_KEYS):
      raise UserError(f"{where}: expected an object with \"vector\" and optionally {', '.join(ENTRY_KEYS[1:])}")
    if isinstance(entry.get("coefficient", 1.0), bool) or not isinstance(entry.get("coefficient", 1.0), (int, float)):
      raise UserError(f"{where}: coefficient must be a number")
    if entry.get("positions", "masked") not in POSITION_CLASSES:
      raise UserError(f"{where}: positions must be one of {', '.join(POSITION_CLASSES)}")
    steps = entry.get("steps")
    if steps is not None and not (isinstance(steps, list) and len(steps) == 2 and all(
        isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in steps) and steps[0] < steps[1]):
      raise UserError(f"{where}: steps must be [start, stop) with 0 <= start < stop")
    entries.append((site, entry))
  return entries


def _vector(path: str, site: str, entry: dict, shape: tuple[int, ...]) -> np.ndarray:
  vector = entry["vector"]
  where = f"steering file {path}, {site!r}"
  if isinstance(vector, str):
    file = os.path.join(os.path.dirname(os.path.abspath(path)), vector)
    try:
      vector = np.load(file, allow_pickle=False)
    except (OSError, ValueError) as e:
      raise UserError(f"{where}: cannot read the vector file {file} ({e})") from None
  try:
    vector = np.asarray(vector, np.float32)
  except (TypeError, ValueError):
    raise UserError(f"{where}: vector must be numbers") from None
  if vector.shape != shape or not np.all(np.isfinite(vector)):
    raise UserError(f"{where}: vector must be {list(shape)} finite numbers for this model, got shape "
                    f"{list(vector.shape)}")
  return vector


def steering(path: str, config: ModelConfig, batch: int, seq_len: int) -> tuple[Hooks, HookValues]:
  """The hooks and traced values of steering file `path` for a model and [B, S] sequences; UserError (one
  line) for a site the model lacks or a vector of another shape."""
  entries = read(path)
  edits = tuple(Edit(site, "add", positions=entry.get("positions", "masked")) for site, entry in entries)
  hooks = Hooks(edits=edits)
  values = {}
  for index, (site, entry) in enumerate(entries):
    kind, layer = sites.parse(site)
    why = sites.unavailable(config, kind, layer)
    if why is not None:
      raise UserError(f"steering file {path}, {site!r}: {why}")
    steps = entry.get("steps")
    values[index] = dict(vector=_vector(path, site, entry, sites.feature_shape(config, kind, layer)),
                         coefficient=float(entry.get("coefficient", 1.0)),
                         window=None if steps is None else tuple(steps))
  return hooks, hook_values(hooks, config, batch, seq_len, edits=values)
