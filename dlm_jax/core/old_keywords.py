"""The deprecation shim of the call path's public entry points: old keyword arguments mapped into the new structs.

`model.forward` and every sampler (`run_family` and each family's `generate`) take a few small structs
instead of one keyword per setting (BUILD.md, "One call plan"). Until the old keywords are removed, each entry
point keeps them in a ``**old_keywords`` parameter and hands them here with its table of moves:

  structs = fold_old_keywords("forward", old_keywords, FORWARD_MOVES, {"readout": readout, ...},
                              defaults={"readout": Readout(), ...})

Each old keyword is written into its struct's field (the struct starts from the default), and one
`DeprecationWarning` per call names the new fields. A keyword that no table knows is a `TypeError`, as Python
gives for an unknown keyword; an old keyword given together with the struct it moved into is a `TypeError`
(which of the two values was meant is not knowable).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class Moved:
  """Where an old keyword lives now: field `field` of the struct passed as parameter `param` (of class
  `struct`, its name for the messages)."""

  param: str
  struct: str
  field: str


def fold_old_keywords(where: str, old_keywords: Mapping[str, Any], moves: Mapping[str, Moved],
                      given: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
  """The entry point's structs with the old keywords written into them.

  where: the entry point's name, for the messages; old_keywords: what its ``**old_keywords`` received; moves:
  old keyword -> `Moved`; given: parameter name -> the struct passed (its default object when not passed);
  defaults: parameter name -> that default object. Returns parameter name -> struct for every parameter of
  `given` (unchanged when no old keyword moved into it). Raises TypeError for an unknown keyword or for an old
  keyword given with the struct it moved into; warns (DeprecationWarning, once per call) otherwise.
  """
  if not old_keywords:
    return dict(given)
  unknown = sorted(set(old_keywords) - set(moves))
  if unknown:
    raise TypeError(f"{where}() got an unexpected keyword argument {unknown[0]!r}.")
  fields: dict[str, dict[str, Any]] = {}
  for name, value in old_keywords.items():
    move = moves[name]
    if given[move.param] is not defaults[move.param]:
      raise TypeError(f"{where}() got both {name}= and {move.param}=; pass {move.param}="
                      f"{move.struct}({move.field}=...) only.")
    fields.setdefault(move.param, {})[move.field] = value
  structs = {moves[name].param: moves[name].struct for name in old_keywords}
  new = ", ".join(f"{param}={struct}({', '.join(f'{field}=...' for field in fields[param])})"
                  for param, struct in structs.items())
  warnings.warn(f"{where}({', '.join(f'{name}=' for name in old_keywords)}) is deprecated; use {new}.",
                DeprecationWarning, stacklevel=3)
  result = dict(given)
  for param, values in fields.items():
    result[param] = dataclasses.replace(given[param], **values)
  return result
