"""Reading a results JSONL (one JSON object per line, each ending in a newline), validated line by line.

The writer (`experiments.common.run_dir.ResultsLog`) appends a whole line of ASCII JSON with one write, flushed and
fsynced, so a crash can leave only one kind of damage: a torn *last* line — bytes with no trailing newline
that begin an object and do not parse. That line, and only that one, may be dropped (`Contents.torn_bytes` says how much).
Anything else — an unparsable or non-object line in the middle, bytes that are not UTF-8, a record without
its key fields — is refused with a one-line `UserError` naming the file and the 1-based line number, and
nothing is changed or deleted. Blank lines are skipped. A complete last object without its newline is
kept (`Contents.needs_newline`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

from dlm_jax.io import json_files
from experiments.common.cli import UserError


@dataclasses.dataclass
class Contents:
  """A results file as read: the records in file order, the byte length of the valid part (`good_end`),
  the bytes of a torn last line after it (0 when none), and whether the last record lacks its newline."""

  records: list[dict[str, Any]]
  good_end: int
  torn_bytes: int
  needs_newline: bool


def _torn(line: bytes) -> bool:
  """True for what an interrupted append can leave: no newline, the start of an object, not yet valid JSON
  (the writer writes ASCII JSON objects, so any prefix of one starts with '{' and is ASCII)."""
  if line.endswith(b"\n") or not line.lstrip().startswith(b"{") or not line.isascii():
    return False
  try:
    json.loads(line)
  except json.JSONDecodeError:
    return True
  return False


def parse(data: bytes, path: str, key_fields: Sequence[str] = ()) -> Contents:
  """The records of results-file bytes `data` (module docstring); `path` is only used in messages."""
  lines = data.splitlines(keepends=True)
  records, good_end = [], 0
  for number, line in enumerate(lines, 1):
    last = number == len(lines)
    where = f"{path}:{number}"
    if not line.strip():
      good_end += len(line)
      continue
    try:
      record = json_files.parse_json(line, where, UserError)
    except UserError as e:
      if last and _torn(line):
        return Contents(records, good_end, len(line), False)
      raise UserError(f"{e}; a results file holds one JSON object per line and only a torn last line (no "
                      "newline) is dropped — repair or remove the file (nothing was changed)") from None
    missing = [k for k in key_fields if k not in record]
    if missing:
      raise UserError(f"{where}: the record lacks the key field {missing[0]!r} (expected "
                      f"{', '.join(repr(k) for k in key_fields)}); nothing was changed")
    records.append(record)
    good_end += len(line)
  return Contents(records, good_end, 0, bool(lines) and not lines[-1].endswith(b"\n"))


def read(path: str, key_fields: Sequence[str] = ()) -> Contents:
  """`parse` of the file at `path` (which must exist)."""
  with open(path, "rb") as f:
    return parse(f.read(), path, key_fields)
