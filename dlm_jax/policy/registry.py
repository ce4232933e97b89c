"""Compute policies by name, and the one text form the binaries and lm-eval use: `NAME` or
`NAME:knob=value,knob=value` (e.g. `sparse_dllm:keep_ratio=0.25`, `dkv_cache:cache_reloading_step=4`).

Every knob is a field of the policy's dataclass; its value is parsed as the field's default's type (bool: true /
false / 1 / 0; a knob whose default is None, e.g. d2cache's query_budget: an int or none). Unknown names and
knobs, unparsable values and knobs out of range are refused in one line, before any model work.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dlm_jax.policy.base import NO_POLICY, ComputePolicy
from dlm_jax.policy.policies import POLICIES


def policy_names() -> tuple[str, ...]:
  """Every selectable name, "none" first."""
  return ("none",) + tuple(POLICIES)


def _knobs(cls: type) -> dict[str, dataclasses.Field]:
  return {f.name: f for f in dataclasses.fields(cls) if f.init and f.name != "layout"}


def _value(name: str, knob: str, text: str, field: dataclasses.Field) -> Any:
  """The knob's value parsed as its field's type: the default's type, or for a default of None the type the
  annotation names besides None ("none" gives None)."""
  kind = type(field.default)
  if field.default is None:
    if text.lower() == "none":
      return None
    annotation = str(field.type)
    kind = next((k for k in (int, float, str) if k.__name__ in annotation), str)
  try:
    if kind is bool:
      if text.lower() not in ("true", "false", "1", "0"):
        raise ValueError
      return text.lower() in ("true", "1")
    return kind(text)
  except ValueError:
    raise ValueError(f"policy {name}: knob {knob}={text!r} is not of type {kind.__name__}.") from None


def _refuse_unknown(name: str) -> None:
  if name != "none" and name not in POLICIES:
    raise ValueError(f"Unknown policy {name!r}; choose one of {', '.join(policy_names())}.")


def make_policy(name: str, **knobs: Any) -> ComputePolicy:
  """The policy `name` with its published defaults, `knobs` overriding them (checked: `check_knobs`)."""
  _refuse_unknown(name)
  if name == "none":
    if knobs:
      raise ValueError(f"policy none takes no knobs, got {', '.join(sorted(knobs))}.")
    return NO_POLICY
  cls = POLICIES[name]
  fields = _knobs(cls)
  unknown = sorted(set(knobs) - set(fields))
  if unknown:
    raise ValueError(f"policy {name} has no knob {unknown[0]!r}; its knobs: {', '.join(fields) or 'none'}.")
  policy = cls(**knobs)
  policy.check_knobs()
  return policy


def parse_policy(text: str) -> ComputePolicy:
  """The policy of `NAME[:knob=value,...]` (module docstring)."""
  if not isinstance(text, str) or not text.strip():
    raise ValueError(f"policy must be NAME or NAME:knob=value,...; choose NAME from {', '.join(policy_names())}.")
  name, _, rest = text.strip().partition(":")
  _refuse_unknown(name)
  knobs = {}
  fields = {} if name == "none" else _knobs(POLICIES[name])
  for part in filter(None, (p.strip() for p in rest.split(","))):
    knob, sep, value = part.partition("=")
    if not sep or not knob:
      raise ValueError(f"policy {name}: {part!r} is not knob=value.")
    if knob not in fields:
      raise ValueError(f"policy {name} has no knob {knob!r}; its knobs: {', '.join(fields) or 'none'}.")
    knobs[knob] = _value(name, knob, value, fields[knob])
  return make_policy(name, **knobs)
