"""Captures over the steps of a sampler run: which steps each capture keeps and where they land.

Every model call returns its captures by name (`StepOutput.captures`, [B, S | P, ...]); the driver keeps
them by the capture's `Steps` (`dlm_jax.instrument.hook_spec`):
  all / at / every   [n, B, ...]: the kept steps in order (a static slot per step number);
  block_starts       [n_blocks, B, ...]: the first call of each block, in block order (slots taken as
                     blocks start: a step starts a block when its block index differs from the last run
                     step's, `Family.block_index`);
  decoded            [B, S, ...]: at each generated position, the value at the step that decoded it
                     (`Trace.decode_step`); zeros at the prompt and at positions never decoded.
`CaptureBuffers.steps` records the step number of every slot (−1: not filled).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dlm_jax.instrument.hook_spec import Steps


@dataclasses.dataclass(frozen=True)
class CaptureLayout:
  """Static facts: the Steps of each captured name, the run's step bound, block count and prompt length."""

  steps: tuple[tuple[str, Steps], ...]
  max_steps: int
  n_blocks: int
  prompt_length: int

  def slots(self, name_steps: Steps) -> int:
    """The number of step slots of a capture (0 for "decoded", which has none)."""
    if name_steps.kind == "decoded":
      return 0
    if name_steps.kind == "block_starts":
      return self.n_blocks
    return sum(s >= 0 for s in name_steps.slots(self.max_steps))

  @property
  def needs_decode_step(self) -> bool:
    return any(s.kind == "decoded" for _, s in self.steps)


def check_layout(layout: CaptureLayout) -> None:
  """Raises ValueError (one line) for a capture that keeps no step of this run."""
  for name, steps in layout.steps:
    if steps.kind in ("at", "every") and layout.slots(steps) == 0:
      raise ValueError(f"capture {name!r} keeps no step of this run: it asks for steps {steps.at or steps.every_k} "
                       f"but the run has at most {layout.max_steps} steps (0..{layout.max_steps - 1}).")


@struct.dataclass
class CaptureBuffers:
  """values: {name: [n, B, ...] or [B, S, ...]}; steps: {name: [n] int32}; last_block, block_starts: scalar
  int32, the block of the last run step (−1 before any) and the number of blocks started."""

  values: dict[str, Any]
  steps: dict[str, jax.Array]
  last_block: jax.Array
  block_starts: jax.Array


def init_buffers(layout: CaptureLayout, shapes: dict[str, Any]) -> CaptureBuffers:
  """Zero buffers for captures of per-call shapes `shapes` ({name: pytree of ShapeDtypeStruct [B, ...]})."""
  by_name = dict(layout.steps)
  values, steps = {}, {}
  for name, shape in shapes.items():
    n = layout.slots(by_name[name])
    if by_name[name].kind == "decoded":
      values[name] = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shape)
    else:
      values[name] = jax.tree.map(lambda s, n=n: jnp.zeros((n, *s.shape), s.dtype), shape)
      steps[name] = jnp.full((n,), -1, jnp.int32)
  return CaptureBuffers(values=values, steps=steps, last_block=jnp.int32(-1), block_starts=jnp.int32(0))


def _write_slot(buffer: jax.Array, value: jax.Array, slot: jax.Array, keep: jax.Array) -> jax.Array:
  at = jnp.maximum(slot, 0)
  old = jax.lax.dynamic_index_in_dim(buffer, at, 0, keepdims=False)
  return jax.lax.dynamic_update_index_in_dim(buffer, jnp.where(keep, value.astype(buffer.dtype), old), at, 0)


def write(layout: CaptureLayout, buffers: CaptureBuffers, captures: dict[str, Any], count: jax.Array,
          ran: jax.Array, block: jax.Array, decode_step: jax.Array | None) -> CaptureBuffers:
  """The buffers after step number `count` (ran: it made its model call; block: its block index;
  decode_step: [B, G] after the step, for "decoded" captures)."""
  starts_block = ran & (block != buffers.last_block)
  values, steps = dict(buffers.values), dict(buffers.steps)
  for name, step_kind in layout.steps:
    value = captures[name]
    if step_kind.kind == "decoded":
      newly = ran & (decode_step == count)
      newly = jnp.concatenate([jnp.zeros((newly.shape[0], layout.prompt_length), bool), newly], axis=1)
      values[name] = jax.tree.map(
          lambda b, v: jnp.where(newly.reshape(newly.shape + (1,) * (v.ndim - 2)), v.astype(b.dtype), b),
          values[name], value)
      continue
    if step_kind.kind == "block_starts":
      slot, keep = buffers.block_starts, starts_block & (buffers.block_starts < layout.n_blocks)
    else:
      table = jnp.asarray(np.asarray(step_kind.slots(layout.max_steps), np.int32))
      slot = table[jnp.minimum(count, layout.max_steps - 1)]
      keep = ran & (slot >= 0)
    values[name] = jax.tree.map(lambda b, v, slot=slot, keep=keep: _write_slot(b, v, slot, keep), values[name], value)
    steps[name] = _write_slot(steps[name], count, slot, keep)
  return CaptureBuffers(values=values, steps=steps, last_block=jnp.where(ran, block, buffers.last_block),
                        block_starts=buffers.block_starts + starts_block.astype(jnp.int32))

