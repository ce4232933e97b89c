"""Step-scheduled steering: an "add" edit whose coefficient and direction are functions of the sampler step
and, optionally, of a reading taken earlier in the same forward (an adaptive gate).

The 2026 steering work on diffusion LMs steers only while an attribute forms, only at masked positions, along
step-dependent directions (Subliminal Clocks' clock direction μ[t̂] − μ[t]) or behind a probe read in the same
forward (`reference/field_2026_12.md` §1.3). Here all of those are one edit inside the compiled sampler:

    value + coefficient[b] · table[b, t] · gate[b, p] · vectors[b, bins[b, t]]      at step t, position p

  table    [B, n] float32: a coefficient per step (constant, windowed, or any per-step table: the host-side
           `CoefficientSchedule` builds it); steps t >= n are not edited.
  bins     [B, n] int32: the step bin of each step, choosing one of the edit's n_bins vectors [B, n_bins, F...]
           (one direction per step bin; n_bins = 1: one direction).
  gate     1 without a `Gate`; else sigmoid(scale[b] · r[b, p] + bias[b]) with r the per-position reading of
           a capture at an earlier layer of the same forward: a linear probe (reduce "project", one direction:
           w · x_l) or a statistic (reduce "norm": ‖x_l‖).
  coefficient [B] the edit's ordinary coefficient (`EditValues.coefficient`): one compiled program serves
           every coefficient of a sweep.

The position class of the `Edit` is the scope (masked-only, committed-only, all, ...). Only the shapes are
static (`StepSchedule`: n, n_bins, the gate's capture); every table, bin map, vector and gate value is traced,
so one program serves every schedule of those shapes. A position whose effective coefficient is 0 is left
bitwise unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dlm_jax.instrument.query_rows import QueryRows
from dlm_jax.instrument.row_values import row_array

GATE_REDUCTIONS = ("project", "norm")
SCHEDULE_KINDS = ("constant", "window", "table")


@dataclasses.dataclass(frozen=True)
class Gate:
  """An adaptive gate: the array name of a capture (`Capture.names`, e.g. "blocks.1.hook_resid_post", or
  "probe.1" for `label="probe"` at layer 1) whose per-position scalar is read in the same forward. The capture
  must be at one layer before every layer of the edit, reduce "project" (one direction) or "norm", keep every
  step, and read a position class (`check`)."""

  capture: str

  def __post_init__(self):
    if not isinstance(self.capture, str) or not self.capture:
      raise ValueError(f"Gate.capture must name a captured array, got {self.capture!r}.")


@dataclasses.dataclass(frozen=True)
class StepSchedule:
  """The static half of a step schedule (module docstring): n_steps, the length n of the per-step table;
  n_bins, the number of vectors per row; gate, a `Gate` or None."""

  n_steps: int
  n_bins: int = 1
  gate: Gate | None = None

  def __post_init__(self):
    for name in ("n_steps", "n_bins"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"StepSchedule.{name} must be a positive integer, got {value!r}.")
    if self.gate is not None and not isinstance(self.gate, Gate):
      raise ValueError(f"StepSchedule.gate must be a Gate or None, got {self.gate!r}.")


@struct.dataclass
class ScheduleValues:
  """Traced values of a step schedule: table [B, n] float32, bins [B, n] int32, gate_scale and gate_bias [B]
  float32 (None without a gate)."""

  table: jax.Array
  bins: jax.Array
  gate_scale: jax.Array | None = None
  gate_bias: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class CoefficientSchedule:
  """A coefficient per step as data (host side): "constant" (`coefficient` at every step), "window"
  (`coefficient` at steps start..stop−1, 0 elsewhere) or "table" (`values[t]` at step t)."""

  kind: str = "constant"
  coefficient: float = 1.0
  start: int = 0
  stop: int = 0
  values: tuple[float, ...] = ()

  def __post_init__(self):
    if self.kind not in SCHEDULE_KINDS:
      raise ValueError(f"schedule kind must be one of {', '.join(SCHEDULE_KINDS)}, got {self.kind!r}.")
    if self.kind == "window" and not (_index(self.start) and _index(self.stop) and self.start < self.stop):
      raise ValueError(f"a window schedule needs steps [start, stop) with 0 <= start < stop, got "
                       f"[{self.start!r}, {self.stop!r}).")
    if self.kind == "table":
      object.__setattr__(self, "values", tuple(self.values))
      if not self.values or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v)
                                    for v in self.values):
        raise ValueError(f"a table schedule needs one finite number per step, got {self.values!r}.")
    if isinstance(self.coefficient, bool) or not isinstance(self.coefficient, (int, float)) or not np.isfinite(
        self.coefficient):
      raise ValueError(f"schedule coefficient must be a finite number, got {self.coefficient!r}.")

  @property
  def last_step(self) -> int | None:
    """The last step the schedule names (None: every step, whatever the run's length)."""
    if self.kind == "window":
      return self.stop - 1
    if self.kind == "table":
      return len(self.values) - 1
    return None

  def table(self, n_steps: int) -> np.ndarray:
    """[n_steps] float32 coefficients; ValueError (one line) when the schedule names a step >= n_steps."""
    last = self.last_step
    if last is not None and last >= n_steps:
      raise ValueError(f"the {self.kind} schedule names step {last}, but the sampler runs at most {n_steps} steps "
                       f"(0..{n_steps - 1}).")
    out = np.zeros((n_steps,), np.float32)
    if self.kind == "constant":
      out[:] = self.coefficient
    elif self.kind == "window":
      out[self.start:self.stop] = self.coefficient
    else:
      out[:len(self.values)] = self.values
    return out


def _index(x) -> bool:
  return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def check(schedule: StepSchedule, edit_layers: tuple[int | None, ...], names: dict[str, Any], what: str) -> None:
  """Raises ValueError (one line) when the gate's capture is missing, not a per-position scalar of one earlier
  layer, or not kept at every step. names: {captured array name: (Capture, its layer)}."""
  if schedule.gate is None:
    return
  name = schedule.gate.capture
  if name not in names:
    raise ValueError(f"{what}: its gate reads capture {name!r}, which no capture produces (captured: "
                     f"{', '.join(sorted(names)) or 'none'}).")
  capture, layer = names[name]
  if capture.layers is None or len(capture.layers) != 1:
    raise ValueError(f"{what}: its gate capture {name!r} must capture one layer (layers=(l,)).")
  if capture.reduce not in GATE_REDUCTIONS or isinstance(capture.positions, tuple) or capture.steps.kind != "all":
    raise ValueError(f"{what}: its gate capture {name!r} must reduce 'project' (one direction) or 'norm' over a "
                     "position class and keep every step (Steps.every_step()).")
  if layer is None or any(l is None or l <= layer for l in edit_layers):
    raise ValueError(f"{what}: its gate capture {name!r} (layer {layer}) must be at a layer before every layer of "
                     f"the edit ({list(edit_layers)}): the gate is read earlier in the same forward.")


def check_steps(schedule: StepSchedule, max_steps: int, what: str) -> None:
  """Raises ValueError (one line) when the schedule's table names steps the sampler never runs."""
  if schedule.n_steps > max_steps:
    raise ValueError(f"{what}: its step schedule has {schedule.n_steps} steps (0..{schedule.n_steps - 1}), but the "
                     f"sampler runs at most {max_steps} steps (0..{max_steps - 1}).")


def schedule_values(schedule: StepSchedule, batch: int, what: str, *, table: Any = None, bins: Any = None,
                    gate_scale: Any = 1.0, gate_bias: Any = 0.0) -> ScheduleValues:
  """Traced values for B rows. table: [n] / [B, n] (default: 1 at every step); bins: [n] / [B, n] int in
  [0, n_bins) (default: bin 0); gate_scale, gate_bias: scalar / [B] (gated schedules only)."""
  n = schedule.n_steps
  table = jnp.ones((batch, n), jnp.float32) if table is None else row_array(table, batch, (n,), jnp.float32,
                                                                            f"{what}: schedule table")
  bins = jnp.zeros((batch, n), jnp.int32) if bins is None else row_array(bins, batch, (n,), jnp.int32,
                                                                         f"{what}: schedule bins")
  if not isinstance(bins, jax.core.Tracer) and (int(jnp.min(bins)) < 0 or int(jnp.max(bins)) >= schedule.n_bins):
    raise ValueError(f"{what}: schedule bins must lie in [0, {schedule.n_bins}), got {int(jnp.min(bins))}.."
                     f"{int(jnp.max(bins))}.")
  out = ScheduleValues(table=table, bins=bins)
  if schedule.gate is not None:
    out = out.replace(gate_scale=row_array(gate_scale, batch, (), jnp.float32, f"{what}: gate_scale"),
                      gate_bias=row_array(gate_bias, batch, (), jnp.float32, f"{what}: gate_bias"))
  return out


def gate_reading(value: jax.Array, reduce: str, rows: QueryRows, t: int) -> jax.Array:
  """[B, T] the gate capture's per-position scalar at the call's T queries (rows: their `QueryRows`), from its
  value in sequence coordinates ([B, S, 1] for "project", [B, S] for "norm")."""
  reading = value[..., 0] if reduce == "project" else value
  return rows.take(reading.astype(jnp.float32), t)


def scheduled_add(values: Any, schedule: ScheduleValues, x: jax.Array, where: jax.Array, step,
                  gate: jax.Array | None) -> jax.Array:
  """x [B, T, F...] + coefficient · table[t] · gate · vectors[bins[t]] where `where` [B, T, 1...] (or per head)
  and the effective coefficient is nonzero; the rest of x bitwise unchanged. values: the edit's
  `EditValues` (coefficient [B], vector [B, n_bins, F...]); gate: [B, T] reading or None."""
  n = schedule.table.shape[1]
  step = jnp.asarray(step, jnp.int32)
  at = jnp.clip(step, 0, n - 1)
  in_table = (step >= 0) & (step < n)
  per_row = values.coefficient * jnp.where(in_table, schedule.table[:, at], 0.0)  # [B]
  bin_index = schedule.bins[:, at]
  vector = jnp.take_along_axis(values.vector, bin_index.reshape((-1,) + (1,) * (values.vector.ndim - 1)),
                               axis=1)  # [B, 1, F...]
  coefficient = jnp.broadcast_to(per_row[:, None], x.shape[:2])
  if gate is not None:
    coefficient = coefficient * jax.nn.sigmoid(schedule.gate_scale[:, None] * gate + schedule.gate_bias[:, None])
  coefficient = coefficient.reshape(coefficient.shape + (1,) * (x.ndim - 2))
  new = x + (coefficient * vector.astype(jnp.float32)).astype(x.dtype)
  return jnp.where(where & (coefficient != 0), new, x)
