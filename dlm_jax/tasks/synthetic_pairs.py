"""Clean / corrupted pairs of the synthetic task (`dlm_jax.tasks.synthetic`) for activation patching.

A pair changes ONE operand of a problem's question — the starting count, an added or removed amount, or
the number of bags or their size — to another value of the range the task draws it from, such that every
intermediate count stays in [0, MAX_VALUE] and the final answer changes. `solve` recomputes the worked
answer of a question in the task's own format, so the corrupted problem is a valid problem of the task.
"""

from __future__ import annotations

import dataclasses
import random
import re

from dlm_jax.tasks.gsm8k import Problem
from dlm_jax.tasks.synthetic import MAX_VALUE

RANGES = {"start": (2, 20), "add": (1, 9), "sub": (1, 9), "bags_k": (2, 4), "bags_b": (2, 5)}
"""The values the task draws each kind of operand from (inclusive)."""
_NUMBER = re.compile(r"\d+")


@dataclasses.dataclass(frozen=True)
class Pair:
  """clean, corrupted: the two problems; operand: the index of the changed number among the question's
  numbers; role: its kind (a key of RANGES); old, new: its values."""

  clean: Problem
  corrupted: Problem
  operand: int
  role: str
  old: int
  new: int


def _roles(question: str) -> list[str]:
  """The kind of each number of the question, in order (raises ValueError for text outside the task)."""
  roles = []
  for sentence in re.split(r"(?<=[.?])\s+", question.strip()):
    count = len(_NUMBER.findall(sentence))
    if " has " in sentence and count == 1 and not roles:
      roles.append("start")
    elif " bags of " in sentence and count == 2:
      roles += ["bags_k", "bags_b"]
    elif sentence.endswith("more.") and count == 1:
      roles.append("add")
    elif re.search(r"(gives away|loses|sells) \d+\.$", sentence) and count == 1:
      roles.append("sub")
    elif not (sentence.startswith("How many") and count == 0):
      raise ValueError(f"not a synthetic-task sentence: {sentence!r}")
  return roles


def solve(question: str) -> tuple[str, list[int]]:
  """(the worked answer in the task's format, every count and product it computes) of a question."""
  numbers = [int(n) for n in _NUMBER.findall(question)]
  roles = _roles(question)
  value, equations, computed, i = numbers[0], [], [], 1
  while i < len(numbers):
    if roles[i] == "add":
      equations.append(f"{value} + {numbers[i]} = {value + numbers[i]}.")
      value += numbers[i]
    elif roles[i] == "sub":
      equations.append(f"{value} - {numbers[i]} = {value - numbers[i]}.")
      value -= numbers[i]
    else:
      k, b = numbers[i], numbers[i + 1]
      equations += [f"{k} * {b} = {k * b}.", f"{value} + {k * b} = {value + k * b}."]
      computed.append(k * b)
      value += k * b
      i += 1
    computed.append(value)
    i += 1
  return " ".join(equations + [f"#### {value}"]), computed


def _replace(question: str, operand: int, value: int) -> str:
  match = list(_NUMBER.finditer(question))[operand]
  return question[:match.start()] + str(value) + question[match.end():]


def corrupt(problem: Problem, rng: random.Random) -> Pair | None:
  """A pair with one operand of `problem` changed (module docstring), drawn from `rng`; None when no
  operand can change without leaving the task's ranges."""
  roles = _roles(problem.question)
  old_numbers = [int(n) for n in _NUMBER.findall(problem.question)]
  clean_final = solve(problem.question)[1][-1]
  operands = list(range(len(roles)))
  rng.shuffle(operands)
  for operand in operands:
    low, high = RANGES[roles[operand]]
    values = [v for v in range(low, high + 1) if v != old_numbers[operand]]
    rng.shuffle(values)
    for value in values:
      question = _replace(problem.question, operand, value)
      answer, computed = solve(question)
      if all(0 <= c <= MAX_VALUE for c in computed) and computed[-1] != clean_final:
        return Pair(clean=problem, corrupted=Problem(question=question, answer=answer), operand=operand,
                    role=roles[operand], old=old_numbers[operand], new=value)
  return None
