"""Reading the JSON files the project is given: decoded as UTF-8 and type-checked, errors naming the file.

Every config.json, index, run record, task line and results line goes through `read_json` or `parse_json`,
so a file that is not UTF-8, not JSON, or JSON of the wrong type (a list where an object is expected) is a
one-line error of the caller's exception type that names the file (and line), never a traceback.
"""

from __future__ import annotations

import json
import os
from typing import Any

_TYPE_NAMES = {dict: "a JSON object", list: "a JSON array", str: "a string", int: "an integer", float: "a number",
               bool: "true or false"}


def type_name(value: Any) -> str:
  """'a JSON object', 'a JSON array', 'null', ... for messages."""
  if value is None:
    return "null"
  for kind, name in _TYPE_NAMES.items():
    if type(value) is kind:  # pylint: disable=unidiomatic-typecheck  (bool is not an int here)
      return name
  return type(value).__name__


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
  keys = [k for k, _ in pairs]
  repeated = sorted({k for k in keys if keys.count(k) > 1})
  if repeated:
    raise ValueError(f"key {repeated[0]!r} appears twice")
  return dict(pairs)


def parse_json(data: bytes, where: str, error: type[Exception] = ValueError, expect: type | None = dict) -> Any:
  """`data` decoded (UTF-8) and parsed, checked to be of type `expect` (None: any); a repeated object key
  is an error too. Raises `error` with a message starting with `where` (a file, or file:line)."""
  try:
    text = data.decode("utf-8")
  except UnicodeDecodeError as e:
    raise error(f"{where} is not valid UTF-8 text (byte {e.start} is 0x{data[e.start]:02x})") from None
  try:
    value = json.loads(text, object_pairs_hook=_no_duplicates)
  except json.JSONDecodeError as e:
    raise error(f"{where} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
  except ValueError as e:  # a repeated key (`_no_duplicates`)
    raise error(f"{where} is not valid: {e}") from None
  if expect is not None and not isinstance(value, expect):
    raise error(f"{where} must hold {_TYPE_NAMES.get(expect, expect.__name__)}, got {type_name(value)}")
  return value


def read_json(path: str | os.PathLike, error: type[Exception] = ValueError, expect: type | None = dict) -> Any:
  """The parsed content of the JSON file `path` (see `parse_json`); an unreadable file raises `error` too."""
  path = os.fspath(path)
  try:
    with open(path, "rb") as f:
      data = f.read()
  except OSError as e:
    raise error(f"{path} cannot be read ({e.strerror or e})") from None
  return parse_json(data, path, error, expect)


def check_fields(record: dict[str, Any], types: dict[str, type | tuple[type, ...]], where: str,
                 error: type[Exception] = ValueError) -> None:
  """Raises `error` unless `record` has every field of `types` with a value of that type (bool is not int)."""
  for name, kind in types.items():
    if name not in record:
      raise error(f"{where}: field {name!r} is missing")
    value = record[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
      wanted = " or ".join(_TYPE_NAMES.get(k, k.__name__) for k in kinds)
      raise error(f"{where}: field {name!r} is {type_name(value)}; expected {wanted}")
