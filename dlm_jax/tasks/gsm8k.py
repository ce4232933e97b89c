"""GSM8K-format records (JSONL with `question` and `answer`, the answer ending in `#### n`) and scoring.

Answer extraction follows lm-evaluation-harness's two GSM8K filters (re-implemented from their
description, ../shared/reference/peers.md §5):

* strict: the first match of `#### (-?[0-9.,]+)` (the harness's "strict-match" regex);
* flexible: the last match of `(-?[$0-9.,]{2,})|(-?[0-9]+)` anywhere in the text ("flexible-extract").

A candidate is normalised before comparison: commas and `$` removed, surrounding whitespace and a
trailing period stripped. Exact match compares normalised strings (as the harness does).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import tempfile
from typing import Iterable, Iterator

from dlm_jax.io import json_files

STRICT_PATTERN = re.compile(r"#### (\-?[0-9\.\,]+)")
FLEXIBLE_PATTERN = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")


@dataclasses.dataclass(frozen=True)
class Problem:
  """One GSM8K-format item: the question (prompt) and the worked answer ending in `#### n`."""

  question: str
  answer: str

  @property
  def target(self) -> str:
    """The normalised reference number (strict extraction of `answer`)."""
    value = extract_strict(self.answer)
    if value is None:
      raise ValueError(f"GSM8K answer has no '#### n' line: {self.answer!r}")
    return value


def normalize_number(text: str) -> str:
  """'$1,234.' -> '1234': drops commas and dollar signs, strips whitespace and a trailing period."""
  text = text.replace(",", "").replace("$", "").strip()
  if text.endswith("."):
    text = text[:-1]
  return text


def extract_strict(text: str) -> str | None:
  """The number after the first '#### ' (normalised), or None when there is none."""
  match = STRICT_PATTERN.search(text)
  return None if match is None else normalize_number(match.group(1))


def extract_flexible(text: str) -> str | None:
  """The last number-looking span of `text` (normalised), or None when there is none."""
  matches = FLEXIBLE_PATTERN.findall(text)
  if not matches:
    return None
  last = matches[-1]
  return normalize_number(last[0] or last[1])


def exact_match(prediction: str | None, target: str) -> bool:
  """True when an extracted prediction equals the (normalised) target string."""
  return prediction is not None and normalize_number(prediction) == normalize_number(target)


def read_jsonl(path: str | os.PathLike) -> list[Problem]:
  """Reads GSM8K-format JSONL (one {"question": str, "answer": str} object per line; blank lines skipped),
  validated whole before anything uses it: a line that is not UTF-8 or not a JSON object, a missing or
  non-string field, or an answer without its `#### n` line raises ValueError naming `path:line` and the
  item (its 0-based index among the records)."""
  path = os.fspath(path)
  problems = []
  with open(path, "rb") as f:
    data = f.read()
  for line_number, line in enumerate(data.splitlines(), 1):
    if not line.strip():
      continue
    where = f"{path}:{line_number} (item {len(problems)})"
    record = json_files.parse_json(line, where)
    json_files.check_fields(record, {"question": str, "answer": str}, where)
    if extract_strict(record["answer"]) is None:
      raise ValueError(f"{where}: the answer has no '#### n' line (GSM8K answers end with '#### <number>'): "
                       f"{record['answer'][-60:]!r}")
    problems.append(Problem(question=record["question"], answer=record["answer"]))
  return problems


def write_jsonl(path: str | os.PathLike, problems: Iterable[Problem]) -> None:
  """Writes problems as GSM8K-format JSONL, atomically (temporary file, then rename)."""
  directory = os.path.dirname(os.path.abspath(path))
  fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".jsonl")
  try:
    with os.fdopen(fd, "w", encoding="utf-8") as f:
      for p in problems:
        f.write(json.dumps({"question": p.question, "answer": p.answer}) + "\n")
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


def iter_scores(problems: Iterable[Problem], completions: Iterable[str]) -> Iterator[dict[str, object]]:
  """Per item: the extracted strict and flexible answers and whether each equals the target."""
  for problem, completion in zip(problems, completions, strict=True):
    strict, flexible = extract_strict(completion), extract_flexible(completion)
    yield {"target": problem.target, "strict": strict, "flexible": flexible,
           "strict_match": exact_match(strict, problem.target),
           "flexible_match": exact_match(flexible, problem.target)}


def accuracy(problems: Iterable[Problem], completions: Iterable[str]) -> dict[str, float]:
  """{"strict_match": fraction, "flexible_match": fraction, "n": count} over paired items."""
  scores = list(iter_scores(problems, completions))
  n = max(len(scores), 1)
  return {"strict_match": sum(s["strict_match"] for s in scores) / n,
          "flexible_match": sum(s["flexible_match"] for s in scores) / n, "n": len(scores)}
