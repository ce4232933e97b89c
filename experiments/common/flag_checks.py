"""The checks of flag values that several binaries' settings share, each failing with its one-line `UserError`.

Each check takes the values as `flag_name=value` keywords and refuses the first bad one, naming the flag and
its value, e.g. `--batch_size=0: expected a positive integer`.
"""

from __future__ import annotations

from collections.abc import Sequence

from experiments.common.cli import UserError


def checkpoints_given(entries: Sequence[str]) -> None:
  """Refuses an empty --checkpoints list."""
  if not entries:
    raise UserError("--checkpoints is empty; give at least one checkpoint")


def not_blank(**values: str | None) -> None:
  """Refuses a path of whitespace only (unset and empty values are left to the binary's default)."""
  for name, value in values.items():
    if value and not value.strip():
      raise UserError(f"--{name}={value!r} is blank; expected a path")


def positive(**values: int) -> None:
  """Refuses a value below 1."""
  for name, value in values.items():
    if value < 1:
      raise UserError(f"--{name}={value}: expected a positive integer")


def above_zero(**values: float) -> None:
  """Refuses a value at or below 0."""
  for name, value in values.items():
    if value <= 0:
      raise UserError(f"--{name}={value}: expected > 0")


def item_count(**values: int) -> None:
  """Refuses a negative number of items (0 = the whole task)."""
  for name, value in values.items():
    if value < 0:
      raise UserError(f"--{name}={value}: expected >= 0 (0 = the whole task)")


def layer_indices(layers: Sequence[int] | None) -> None:
  """Refuses a negative index in --layers (None: every layer)."""
  if layers is not None and any(layer < 0 for layer in layers):
    raise UserError(f"--layers={','.join(map(str, layers))}: expected layer indices >= 0")


def layers_of_model(layers: Sequence[int] | None, label: str, n_layers: int) -> None:
  """Refuses an index in --layers that model `label`, with `n_layers` layers, does not have."""
  if layers is not None and any(layer >= n_layers for layer in layers):
    raise UserError(f"--layers={','.join(map(str, layers))}: {label} has {n_layers} layers (0 to {n_layers - 1})")
