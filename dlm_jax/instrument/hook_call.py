"""The traced half of an instrumented call: the values of captures and edits, and `HookCall`, what one
forward call receives (`dlm_jax.model.forward(..., hooks=HookCall(...))`).

Shapes: B rows, S sequence positions (the sequence, or the KV-cache length), Le the edit's layers
(`Hooks.resolved_layers`), M patched steps, F the site's feature shape (`dlm_jax.instrument.sites`), N the
site's heads (query heads, or kv heads at hook_k / hook_v), R directions, k top entries.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dlm_jax.config import ModelConfig
from dlm_jax.instrument import sae_hooks, sites
from dlm_jax.instrument.hook_spec import Hooks
from dlm_jax.instrument.row_values import row_array
from dlm_jax.instrument.sae import SAE
from dlm_jax.instrument.step_schedule import ScheduleValues, schedule_values

VALID, PROMPT, MASKED, DECODED, COMMITTED = 1, 2, 4, 8, 16
"""Position-class bits of a query (`HookCall.flags`); a real query has VALID and one of the others."""
CLASS_BITS = {"all": VALID, "prompt": PROMPT, "masked": MASKED, "decoded": DECODED, "committed": COMMITTED}

NO_STEP_LIMIT = np.iinfo(np.int32).max


def class_mask(position_class: str, flags: jax.Array) -> jax.Array:
  """[B, T] bool: the queries of `position_class` given their class bits flags [B, T] int32."""
  return (flags & CLASS_BITS[position_class]) != 0


@struct.dataclass
class CaptureValues:
  """Traced inputs of one capture. directions: [R, F_last] float ("project"); targets: [B, S] int32 token
  per sequence position ("lens": the token whose probability and rank are read, e.g. the finally decoded
  one); sae: the sparse autoencoder ("sae")."""

  directions: jax.Array | None = None
  targets: jax.Array | None = None
  sae: SAE | None = None


@struct.dataclass
class EditValues:
  """Traced inputs of one edit: where, when and by how much (`dlm_jax.instrument.hook_spec.Edit`).

  window: [B, 2] int32, the steps [start, stop) at which the row is edited (a plain forward call is step 0).
  layers: [B, Le] bool, the edit's layers the row is edited at.
  positions: [B, S] bool, the sequence positions the row may be edited at (within the edit's class).
  heads: [B, N] bool at a per-head site (which heads), else None.
  coefficient: [B] float32 ("add", "scale").
  vector: [B, F...] ("replace" / "add" with source "vector"), else None.
  values: [M, Le, B, S, F...] ("replace" / "add" with source "values"): the value at step value_steps[m],
    layer Le, sequence position; value_steps: [M] int32 (a step not listed is not edited).
  schedule: an edit with a `StepSchedule`: its `ScheduleValues` (table, bins, gate; `vector` is then
    [B, n_bins, F...], one direction per step bin; `dlm_jax.instrument.step_schedule`), else None.
  sae: the sparse autoencoder of "sae_splice" / "sae_features"; feature_mask [B, d_sae] bool with
    feature_value [B, d_sae] (features clamped), feature_add [B, d_sae] (added to the activations), else None
    (`dlm_jax.instrument.sae_hooks`).
  """

  window: jax.Array
  layers: jax.Array
  positions: jax.Array
  heads: jax.Array | None = None
  coefficient: jax.Array | None = None
  vector: jax.Array | None = None
  values: jax.Array | None = None
  value_steps: jax.Array | None = None
  schedule: ScheduleValues | None = None
  sae: SAE | None = None
  feature_mask: jax.Array | None = None
  feature_value: jax.Array | None = None
  feature_add: jax.Array | None = None


EDIT_BATCH_AXES = {"window": 0, "layers": 0, "positions": 0, "heads": 0, "coefficient": 0, "vector": 0,
                   "values": 2, "value_steps": None, "schedule": 0, "sae": None, "feature_mask": 0,
                   "feature_value": 0, "feature_add": 0}


def edit_values(hooks: Hooks, index: int, config: ModelConfig, batch: int, seq_len: int, *,
                window: Any = None, layers: Any = None, positions: Any = None, heads: Any = None,
                coefficient: Any = 1.0, vector: Any = None, values: Any = None, value_steps: Any = None,
                schedule: dict | None = None, sae: SAE | None = None, feature_mask: Any = None,
                feature_value: Any = None, feature_add: Any = None) -> EditValues:
  """The traced values of edit `hooks.edits[index]` for [B, S] sequences, with defaults: every step (window),
  every one of its layers, every position, every head, coefficient 1; `vector` / `values` as its op and
  source need. Each argument may be given for every row ([...]) or per row ([B, ...]).

  window: (start, stop) steps, or [B, 2]; layers: [Le] / [B, Le] bool; positions: [S] / [B, S] bool; heads:
  [N] / [B, N] bool (per-head sites only); coefficient: scalar or [B]; vector: [F...] or [B, F...]
  ([n_bins, F...] or [B, n_bins, F...] with a step schedule); schedule: keyword arguments of
  `dlm_jax.instrument.step_schedule.schedule_values` (an edit with a `StepSchedule` only);
  values: [M, Le, B, S, F...] with value_steps [M] int32 (sequence coordinates, e.g. a captured run's arrays
  stacked by `patch_values`); sae, feature_mask / feature_value / feature_add: [d_sae] or [B, d_sae] (the SAE
  ops, `dlm_jax.instrument.sae_hooks`).
  """
  edit = hooks.edits[index]
  resolved = hooks.resolved_layers(config, edit)
  feature = sites.feature_shape(config, edit.site, resolved[0])
  what = f"Edit {index} ({edit.site}, {edit.op})"
  if edit.schedule is not None:
    feature = (edit.schedule.n_bins, *feature)
  elif schedule is not None:
    raise ValueError(f"{what} has no StepSchedule; it takes no schedule values.")
  window = (0, NO_STEP_LIMIT) if window is None else window
  out = EditValues(
      window=row_array(window, batch, (2,), jnp.int32, f"{what}: window"),
      layers=jnp.ones((batch, len(resolved)), bool) if layers is None
      else row_array(layers, batch, (len(resolved),), bool, f"{what}: layers"),
      positions=jnp.ones((batch, seq_len), bool) if positions is None
      else row_array(positions, batch, (seq_len,), bool, f"{what}: positions"))
  if edit.site in sites.HEAD_SITES:
    out = out.replace(heads=jnp.ones((batch, feature[0]), bool) if heads is None
                      else row_array(heads, batch, (feature[0],), bool, f"{what}: heads"))
  elif heads is not None:
    raise ValueError(f"{what}: heads are chosen at per-head sites ({', '.join(sites.HEAD_SITES)}) only.")
  if edit.op in ("add", "scale"):
    out = out.replace(coefficient=row_array(coefficient, batch, (), jnp.float32, f"{what}: coefficient"))
  needs_source = edit.op in ("replace", "add")
  if needs_source and edit.source == "vector":
    if vector is None:
      raise ValueError(f"{what} with source 'vector' needs vector [F...] = {list(feature)} or [B, F...].")
    out = out.replace(vector=row_array(vector, batch, feature, jnp.float32, f"{what}: vector"))
  if needs_source and edit.source == "values":
    if values is None or value_steps is None:
      raise ValueError(f"{what} with source 'values' needs values [M, Le, B, S, F...] and value_steps [M].")
    values, value_steps = jnp.asarray(values), jnp.asarray(value_steps, jnp.int32)
    expected = (value_steps.shape[0], len(resolved), batch, seq_len, *feature)
    if value_steps.ndim != 1 or values.shape != expected:
      raise ValueError(f"{what}: values must be [M, Le, B, S, F...] = {list(expected)} with value_steps [M]; got "
                       f"{list(values.shape)} and {list(value_steps.shape)}.")
    out = out.replace(values=values, value_steps=value_steps)
  elif values is not None or (vector is not None and not needs_source):
    raise ValueError(f"{what} takes no {'values' if values is not None else 'vector'} (op {edit.op!r}, source "
                     f"{edit.source!r}).")
  if edit.schedule is not None:
    out = out.replace(schedule=schedule_values(edit.schedule, batch, what, **(schedule or {})))
  return out.replace(**sae_hooks.edit_fields(edit, config, resolved, batch, what, row_array, sae, feature_mask,
                                             feature_value, feature_add))


@struct.dataclass
class HookValues:
  """The traced values of a `Hooks`: one `CaptureValues` per capture, one `EditValues` per edit."""

  captures: tuple[CaptureValues, ...] = ()
  edits: tuple[EditValues, ...] = ()


def hook_values(hooks: Hooks, config: ModelConfig, batch: int, seq_len: int, *,
                captures: dict[int, CaptureValues] | None = None, edits: dict[int, dict] | None = None
                ) -> HookValues:
  """`HookValues` for [B, S] sequences: captures {index: CaptureValues} (default: none needed); edits
  {index: keyword arguments of `edit_values`} (default: the edit everywhere, coefficient 1). Raises when a
  capture lacks its directions or targets."""
  captures, edits = captures or {}, edits or {}
  capture_values = []
  for i, capture in enumerate(hooks.captures):
    value = captures.get(i, CaptureValues())
    if capture.reduce == "project" and (value.directions is None or jnp.ndim(value.directions) != 2):
      raise ValueError(f"Capture {i} ({capture.site}, project) needs CaptureValues(directions=[R, F_last]).")
    if capture.reduce == "lens" and (value.targets is None or jnp.shape(value.targets) != (batch, seq_len)):
      raise ValueError(f"Capture {i} ({capture.site}, lens) needs CaptureValues(targets=[B, S] = "
                       f"{[batch, seq_len]} token ids).")
    if capture.reduce == "sae":
      if value.sae is None:
        raise ValueError(f"Capture {i} ({capture.site}, sae) needs CaptureValues(sae=SAE).")
      sae_hooks.check_width(value.sae, config, capture.site, hooks.resolved_layers(config, capture),
                            f"Capture {i} ({capture.site}, sae)")
    capture_values.append(value)
  names = hooks.capture_names(config) if any(e.schedule is not None and e.schedule.gate is not None
                                             for e in hooks.edits) else {}
  for i, edit in enumerate(hooks.edits):
    if edit.schedule is not None and edit.schedule.gate is not None and edit.schedule.gate.capture in names:
      gate = names[edit.schedule.gate.capture]
      directions = capture_values[gate].directions
      if hooks.captures[gate].reduce == "project" and jnp.shape(directions)[0] != 1:
        raise ValueError(f"Edit {i} ({edit.site}): its gate capture {edit.schedule.gate.capture!r} projects on "
                         f"{jnp.shape(directions)[0]} directions; a gate reads one (directions [1, F_last]).")
  return HookValues(captures=tuple(capture_values),
                    edits=tuple(edit_values(hooks, i, config, batch, seq_len, **edits.get(i, {}))
                                for i in range(len(hooks.edits))))


@struct.dataclass
class HookCall:
  """What one forward call is given: the static `Hooks`, their traced values, the class bits of the call's
  queries and the step.

  flags: [B, T] int32 class bits (`VALID`, `PROMPT`, …) of the call's queries; None counts every query as
    VALID only ("all").
  step: scalar int32, the sampler step (0 for a plain forward call).
  keep: [n captures] bool, whether each capture keeps this call's step (its `Steps`), or None (every
    capture does); costly reductions are skipped where it is False (`dlm_jax.instrument.site_hooks`).
  """

  hooks: Hooks = struct.field(pytree_node=False)
  values: HookValues
  flags: jax.Array | None = None
  step: jax.Array | int = 0
  keep: jax.Array | None = None

  def map_rows(self, rows: Callable[[jax.Array, int], jax.Array]) -> HookCall:
    """This call with rows(x, batch axis) applied to every array that has a batch axis (e.g. doubling the
    rows under CFG); the others are kept."""
    def edit(values: EditValues) -> EditValues:
      return values.replace(**{name: None if getattr(values, name) is None or axis is None
                               else jax.tree.map(lambda x, axis=axis: rows(x, axis), getattr(values, name))
                               for name, axis in EDIT_BATCH_AXES.items() if axis is not None})
    captures = tuple(v.replace(targets=None if v.targets is None else rows(v.targets, 0))
                     for v in self.values.captures)
    return self.replace(values=HookValues(captures=captures, edits=tuple(edit(v) for v in self.values.edits)),
                        flags=None if self.flags is None else rows(self.flags, 0))


def row_slices(call: HookCall) -> tuple[HookCall, Callable[[HookCall], HookCall]]:
  """For `lax.map` over rows: (the call with every batch-bearing array split to [B, ..., 1 at its axis, ...]
  and every other array dropped, a function rebuilding one row's call from a mapped slice)."""
  def split(x, axis):
    return jnp.expand_dims(jnp.moveaxis(x, axis, 0), axis + 1)

  split_call = call.map_rows(split)
  shared = call

  def drop_shared(c: HookCall) -> HookCall:
    edits = tuple(v.replace(value_steps=None, sae=None) for v in c.values.edits)
    captures = tuple(v.replace(directions=None, sae=None) for v in c.values.captures)
    return c.replace(values=HookValues(captures=captures, edits=edits), step=None, keep=None)

  def rebuild(row: HookCall) -> HookCall:
    edits = tuple(r.replace(value_steps=s.value_steps, sae=s.sae) for r, s in zip(row.values.edits,
                                                                                  shared.values.edits))
    captures = tuple(r.replace(directions=s.directions, sae=s.sae) for r, s in zip(row.values.captures,
                                                                                   shared.values.captures))
    return row.replace(values=HookValues(captures=captures, edits=edits), step=shared.step, keep=shared.keep)

  return drop_shared(split_call), rebuild
