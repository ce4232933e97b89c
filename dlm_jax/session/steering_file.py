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

Step schedules (issue 33; `dlm_jax.instrument.step_schedule`; files without these keys read as before):
  schedule     a per-step coefficient table [c_0, c_1, ...]: step t is steered by coefficient · c_t; steps
               after the table are not steered (instead of "steps");
  bins         the step bin of each step [b_0, b_1, ...] (the table's length; a table of ones when there is
               no "schedule"): "vector" is then one direction per bin, [n_bins, F...] (e.g. the clock
               direction μ[t̂] − μ[t] of each step bin);
  gate         {"site": a full site name at an earlier layer, "reduce": "project" (default; with "direction",
               a list or a .npy file of the site's width) or "norm", "scale" (default 1), "bias" (default 0)}:
               each position's coefficient is multiplied by sigmoid(scale · r + bias), r the probe reading
               (w · x) or the norm of x at that site, read in the same forward; needs "schedule", "bins" or
               "steps".
A scheduled entry names steps 0..n−1 (n: the table's length, the bins' length, or the window's stop); a
sampler that runs fewer steps refuses it in one line before any model work.
"""

from __future__ import annotations

import json
import os

import numpy as np

from dlm_jax.config import ModelConfig
from dlm_jax.instrument import sites
from dlm_jax.instrument import step_schedule
from dlm_jax.instrument.hook_call import CaptureValues, HookValues, hook_values
from dlm_jax.instrument.hook_spec import POSITION_CLASSES, Capture, Edit, Hooks
from dlm_jax.instrument.step_schedule import GATE_REDUCTIONS
from dlm_jax.session.errors import SessionError

ENTRY_KEYS = ("vector", "coefficient", "positions", "steps", "schedule", "bins", "gate")
GATE_KEYS = ("site", "reduce", "direction", "scale", "bias")


def read(path: str) -> list[tuple[str, dict]]:
  """The file's entries [(site, entry)], checked for their form (not yet against a model); SessionError names
  the file and the entry."""
  try:
    with open(path, encoding="utf-8") as f:
      spec = json.load(f)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise SessionError(f"steering file {path}: cannot read it as JSON ({e})") from None
  if not isinstance(spec, dict) or not spec:
    raise SessionError(f"steering file {path}: expected a non-empty JSON object {{site: entry}}")
  entries = []
  for site, entry in spec.items():
    where = f"steering file {path}, {site!r}"
    try:
      kind, layer = sites.parse(site)
      Edit(site, "add")
    except ValueError as e:
      raise SessionError(f"{where}: {e}") from None
    if not isinstance(entry, dict) or "vector" not in entry or set(entry) - set(ENTRY_KEYS):
      raise SessionError(f"{where}: expected an object with \"vector\" and optionally {', '.join(ENTRY_KEYS[1:])}")
    if isinstance(entry.get("coefficient", 1.0), bool) or not isinstance(entry.get("coefficient", 1.0), (int, float)):
      raise SessionError(f"{where}: coefficient must be a number")
    if entry.get("positions", "masked") not in POSITION_CLASSES:
      raise SessionError(f"{where}: positions must be one of {', '.join(POSITION_CLASSES)}")
    steps = entry.get("steps")
    if steps is not None and not (isinstance(steps, list) and len(steps) == 2 and all(
        isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in steps) and steps[0] < steps[1]):
      raise SessionError(f"{where}: steps must be [start, stop) with 0 <= start < stop")
    _check_schedule(where, layer, entry)
    entries.append((site, entry))
  return entries


def _numbers(x) -> bool:
  return isinstance(x, list) and bool(x) and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                 and np.isfinite(v) for v in x)


def _check_schedule(where: str, layer: int | None, entry: dict) -> None:
  """The form of an entry's "schedule", "bins" and "gate" (module docstring)."""
  table, bins, gate = entry.get("schedule"), entry.get("bins"), entry.get("gate")
  if table is not None and not _numbers(table):
    raise SessionError(f"{where}: schedule must be a non-empty list of finite numbers, one per step")
  if table is not None and "steps" in entry:
    raise SessionError(f"{where}: give either steps (a window) or schedule (a per-step table), not both")
  if bins is not None and not (isinstance(bins, list) and bins and all(
      isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in bins)):
    raise SessionError(f"{where}: bins must be a non-empty list of step bins >= 0, one per step")
  if bins is not None and table is not None and len(bins) != len(table):
    raise SessionError(f"{where}: bins has {len(bins)} steps but schedule has {len(table)}; give one of each per step")
  if gate is None:
    return
  if not isinstance(gate, dict) or "site" not in gate or set(gate) - set(GATE_KEYS):
    raise SessionError(f"{where}: gate must be an object with \"site\" and optionally {', '.join(GATE_KEYS[1:])}")
  if table is None and "steps" not in entry and bins is None:
    raise SessionError(f"{where}: a gate needs schedule, bins or steps (the steps it may act at)")
  try:
    gate_kind, gate_layer = sites.parse(gate["site"])
  except ValueError as e:
    raise SessionError(f"{where}: gate: {e}") from None
  if gate_layer is None or layer is None or gate_layer >= layer:
    raise SessionError(f"{where}: gate site {gate['site']!r} must be a per-layer site before layer {layer}")
  if gate.get("reduce", "project") not in GATE_REDUCTIONS:
    raise SessionError(f"{where}: gate reduce must be one of {', '.join(GATE_REDUCTIONS)}")
  if (gate.get("reduce", "project") == "project") != ("direction" in gate):
    raise SessionError(f"{where}: a gate with reduce 'project' needs a direction, and only such a gate takes one")
  for name in ("scale", "bias"):
    value = gate.get(name, 0.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value):
      raise SessionError(f"{where}: gate {name} must be a finite number")


def _n_steps(entry: dict) -> int:
  """The steps a scheduled entry names (its table's length, its bins' length, or its window's stop)."""
  if "schedule" in entry:
    return len(entry["schedule"])
  if "bins" in entry:
    return len(entry["bins"])
  return entry["steps"][1]


def _scheduled(entry: dict) -> bool:
  return any(key in entry for key in ("schedule", "bins", "gate"))


def _vector(path: str, site: str, entry: dict, shape: tuple[int, ...], key: str = "vector") -> np.ndarray:
  vector = entry[key]
  where = f"steering file {path}, {site!r}" + ("" if key == "vector" else ", gate")
  if isinstance(vector, str):
    file = os.path.join(os.path.dirname(os.path.abspath(path)), vector)
    try:
      vector = np.load(file, allow_pickle=False)
    except (OSError, ValueError) as e:
      raise SessionError(f"{where}: cannot read the vector file {file} ({e})") from None
  try:
    vector = np.asarray(vector, np.float32)
  except (TypeError, ValueError):
    raise SessionError(f"{where}: vector must be numbers") from None
  if vector.shape != shape or not np.all(np.isfinite(vector)):
    raise SessionError(f"{where}: {key} must be {list(shape)} finite numbers for this model, got shape "
                       f"{list(vector.shape)}")
  return vector


def steering(path: str, config: ModelConfig, batch: int, seq_len: int) -> tuple[Hooks, HookValues]:
  """The hooks and traced values of steering file `path` for a model and [B, S] sequences; SessionError (one
  line) for a site the model lacks or a vector of another shape."""
  entries = read(path)
  edits, captures, values, capture_values = [], [], {}, {}
  for index, (site, entry) in enumerate(entries):
    kind, layer = sites.parse(site)
    for name in (site, entry.get("gate", {}).get("site")):
      why = None if name is None else sites.unavailable(config, *sites.parse(name))
      if why is not None:
        raise SessionError(f"steering file {path}, {site!r}: {why}")
    feature = sites.feature_shape(config, kind, layer)
    schedule, value = None, dict(coefficient=float(entry.get("coefficient", 1.0)))
    if _scheduled(entry):
      n_steps = _n_steps(entry)
      bins = entry.get("bins")
      n_bins = 1 if bins is None else max(bins) + 1
      gate = None
      if "gate" in entry:
        gate_kind, gate_layer = sites.parse(entry["gate"]["site"])
        reduce = entry["gate"].get("reduce", "project")
        label = f"steering_gate_{index}"
        captures.append(Capture(gate_kind, layers=(gate_layer,), reduce=reduce, label=label))
        if reduce == "project":
          capture_values[len(captures) - 1] = CaptureValues(directions=_vector(
              path, site, entry["gate"], sites.feature_shape(config, gate_kind, gate_layer), "direction")[None])
        gate = step_schedule.Gate(f"{label}.{gate_layer}")
      schedule = step_schedule.StepSchedule(n_steps, n_bins, gate)
      table = entry.get("schedule")
      if table is None and "steps" in entry:
        try:
          table = step_schedule.CoefficientSchedule("window", 1.0, *entry["steps"]).table(n_steps)
        except ValueError as e:
          raise SessionError(f"steering file {path}, {site!r}: steps {entry['steps']} against bins: {e}") from None
      gate_values = {} if gate is None else dict(gate_scale=float(entry["gate"].get("scale", 1.0)),
                                                 gate_bias=float(entry["gate"].get("bias", 0.0)))
      value["schedule"] = dict(table=table, bins=bins, **gate_values)
      value["vector"] = _vector(path, site, entry, feature if bins is None else (n_bins, *feature))
      if bins is None:
        value["vector"] = value["vector"][None]
    else:
      steps = entry.get("steps")
      value.update(vector=_vector(path, site, entry, feature), window=None if steps is None else tuple(steps))
    edits.append(Edit(site, "add", positions=entry.get("positions", "masked"), schedule=schedule))
    values[index] = value
  hooks = Hooks(captures=tuple(captures), edits=tuple(edits))
  try:
    hooks.check(config)
    return hooks, hook_values(hooks, config, batch, seq_len, captures=capture_values, edits=values)
  except ValueError as e:
    raise SessionError(f"steering file {path}: {e}") from None
