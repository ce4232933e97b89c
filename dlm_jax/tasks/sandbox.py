"""Running untrusted (model-written) Python against a test, isolated, with a verdict the caller can trust.

`run(solution, test, entry_point, limits)` executes `solution`, then `test` (compiled separately), then
`check(<entry_point>)` in a separate process tree and says passed / failed / timed out. Layers, each
applied where the OS allows and listed in `Outcome.isolation`:

- the evaluator: the child starts in a new session (it and its process group can be killed at once,
  and it cannot signal the caller's group), with an environment holding only PATH, HOME, TMPDIR and LANG
  (nothing inherited), in a private work directory removed afterwards (`sandbox_workdir`), in a pids
  cgroup of its own where one can be made (`sandbox_cgroup`), and with a hard deadline (the caller
  never waits on a descendant that escaped);
- `unshare --user --net --pid --mount-proc` when it works (probed once per process): no network
  interface but loopback (down), a PID namespace in which the caller's processes do not exist and
  whose every process the kernel kills when its first process (the supervisor) exits, and a tmpfs of
  bounded size as the work directory;
- the supervisor (`sandbox_child`): subreaper of every orphan below it, time limit, output read
  incrementally and capped, every descendant killed at the end;
- the worker (`sandbox_limits`): own session, rlimits (address space, CPU, file size, processes), no
  capabilities, Landlock (writes only in the work directory, reads only of the interpreter and system
  libraries, no TCP, no signals out), and where neither a PID namespace nor Landlock confines signals,
  a seccomp filter (`sandbox_seccomp`).

The verdict is "passed" only if the worker wrote this run's nonce (128 random bits from `secrets`,
sent on a file descriptor the supervisor reads and closes before any untrusted code exists) on its
result pipe, which it does only after `check` returned; an early exit with status 0, text printed
on stdout, or anything in the program's files, environment or argv cannot produce it. Code that
deliberately tampers with its own interpreter (reads the worker's frames to find the nonce, patches
builtins the test uses, returns objects equal to everything) is out of reach of any harness that
runs the test in the same process; see docs/guides/trust.md.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Literal

from dlm_jax.tasks import sandbox_cgroup, sandbox_workdir

Status = Literal["passed", "failed", "timed out"]

_UNSHARE_FLAGS = ("--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child", "--mount-proc")
_GRACE_S = 10.0
_REPORT_BYTES = 1 << 20
_DETAIL_CHARS = 2000
_TRIVIAL = ("def f():\n  return 1\n", "def check(f):\n  assert f() == 1\n", "f")
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclasses.dataclass(frozen=True)
class Limits:
  """Per-run limits: wall-clock seconds (CPU gets the same, rounded up, plus 1), address space, total
  output (stdout and stderr), size of any one file written, processes, and the size of the work
  directory (a tmpfs, where the run has its own mount namespace)."""

  time_s: float = 10.0
  memory_bytes: int = 1 << 30
  output_bytes: int = 1 << 20
  file_bytes: int = 16 << 20
  processes: int = 8
  disk_bytes: int = 64 << 20

  def __post_init__(self):
    for field in dataclasses.fields(self):
      if not getattr(self, field.name) > 0:
        raise ValueError(f"sandbox limit {field.name}={getattr(self, field.name)!r}: expected a positive number")


@dataclasses.dataclass(frozen=True)
class Outcome:
  """Verdict, the tail of the program's output (or why it failed), and the isolation applied."""

  status: Status
  detail: str
  isolation: tuple[str, ...]


def run(solution: str, test: str, entry_point: str, limits: Limits = Limits(),
        namespaces: bool | None = None) -> Outcome:
  """Runs `solution`, then `test`, then `check(<entry_point>)` in the sandbox.

  namespaces: None to use `unshare` namespaces where they work (probed once per process), False to run
  without them (the other layers only).
  """
  if not entry_point.isidentifier():
    raise ValueError(f"entry_point {entry_point!r}: expected a Python identifier")
  available, note = _namespaces()
  if namespaces is False:
    available, note = False, "namespaces: none (not requested)"
  return _run(solution, test, entry_point, limits, available, note)


def isolation() -> tuple[str, ...]:
  """The isolation `run` applies on this machine (runs a trivial program once)."""
  return run(*_TRIVIAL).isolation


@functools.cache
def _namespaces() -> tuple[bool, str]:
  """Whether `unshare` namespaces work here (probed once), and the line describing it. First removes
  what runs of evaluators that died left behind, and checks that a trivial program passes without
  namespaces (RuntimeError if not: a broken sandbox must not score every completion as failed)."""
  sandbox_workdir.remove_stale()
  sandbox_cgroup.remove_stale()
  plain = _run(*_TRIVIAL, Limits(time_s=20.0), False, "")
  if plain.status != "passed":
    raise RuntimeError(f"sandbox: a trivial program does not pass here ({_last_line(plain)})")
  if shutil.which("unshare") is None:
    return False, "namespaces: none (no unshare command)"
  probe = _run(*_TRIVIAL, Limits(time_s=20.0), True, "")
  if probe.status == "passed":
    return True, "namespaces: user, network (no interfaces up), PID (caller invisible), mount (own /proc)"
  return False, f"namespaces: none (unshare failed: {_last_line(probe)})"


def _last_line(outcome: Outcome) -> str:
  return (outcome.detail.strip().splitlines() or [outcome.status])[-1][:200]


def _run(solution: str, test: str, entry_point: str, limits: Limits, namespaces: bool, note: str) -> Outcome:
  workdir, lock = sandbox_workdir.create()
  cgroup = sandbox_cgroup.create(limits.processes + 1)
  nonce = secrets.token_hex(16)
  job = {"solution": solution, "test": test, "entry_point": entry_point, "nonce": nonce, "workdir": workdir,
         "time_s": limits.time_s, "memory_bytes": limits.memory_bytes, "output_bytes": limits.output_bytes,
         "file_bytes": limits.file_bytes, "processes": _processes(limits.processes, namespaces), "cgroup": cgroup,
         "namespaces": namespaces, "disk_bytes": limits.disk_bytes}
  try:
    with tempfile.TemporaryFile() as job_file:
      job_file.write(json.dumps(job).encode())
      job_file.flush()
      job_file.seek(0)
      boot = (f"import sys; sys.path.insert(0, {_PACKAGE_ROOT!r}); from dlm_jax.tasks import sandbox_child; "
              f"del sys.path[0]; sandbox_child.main({job_file.fileno()})")
      command = [sys.executable, "-I", "-c", boot]
      if namespaces:
        command = [shutil.which("unshare"), *_UNSHARE_FLAGS, "--", *command]
      text, finished = _spawn(command, workdir, job_file.fileno(), limits.time_s + _GRACE_S)
  finally:
    sandbox_workdir.remove(workdir, lock)
    if cgroup:
      sandbox_cgroup.remove(cgroup)
  isolation = ["own session and process group", "environment: PATH, HOME, TMPDIR and LANG only",
               "private work directory, removed afterwards", f"output cap {limits.output_bytes} bytes"]
  isolation += [note] if note else []
  return _verdict(text, finished, nonce, limits, isolation)


def _verdict(text: str, finished: bool, nonce: str, limits: Limits, isolation: list[str]) -> Outcome:
  """Reads the supervisor's report (its last line) into an Outcome."""
  try:
    report = json.loads(text.strip().splitlines()[-1])
    confinement, _, token = report["result"].partition("\n")
  except (IndexError, ValueError, KeyError, TypeError, AttributeError):
    status = "failed" if finished else "timed out"
    return Outcome(status, ("sandbox: no report from the supervisor\n" + text)[-_DETAIL_CHARS:], tuple(isolation))
  try:
    isolation += json.loads(confinement)
  except ValueError:
    isolation.append("worker confinement: none reported (the worker failed before running the program)")
  if report.get("cgroup"):
    isolation.append(f"pids cgroup: at most {limits.processes} processes besides the supervisor")
  if report.get("tmpfs"):
    isolation.append(f"work directory: a tmpfs of {limits.disk_bytes >> 20} MiB in the run's mount namespace")
  detail = report["output"][-_DETAIL_CHARS:]
  if report["status"] == "timed out":
    return Outcome("timed out", f"no result within {limits.time_s} s", tuple(isolation))
  if report["status"] == "output limit":
    return Outcome("failed", f"printed more than {limits.output_bytes} bytes (stopped)\n{detail}", tuple(isolation))
  if report["exit_code"] == 0 and token == nonce:
    return Outcome("passed", detail, tuple(isolation))
  if report["exit_code"] == 0:
    detail = (detail + "\nexited before the tests finished").strip()
  return Outcome("failed", detail, tuple(isolation))


def _spawn(command: list[str], workdir: str, job_fd: int, deadline_s: float) -> tuple[str, bool]:
  """Runs the sandbox; (its stdout and stderr, capped, and whether it ended before the deadline)."""
  env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}
  deadline = time.monotonic() + deadline_s
  process = subprocess.Popen(  # pylint: disable=consider-using-with
      command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
      cwd=workdir, start_new_session=True, pass_fds=(job_fd,))
  output = bytearray()
  try:
    with selectors.DefaultSelector() as selector:
      selector.register(process.stdout, selectors.EVENT_READ)
      while len(output) < _REPORT_BYTES and time.monotonic() < deadline:
        if selector.select(deadline - time.monotonic()):
          data = os.read(process.stdout.fileno(), 65536)
          if not data:
            break
          output += data
    process.wait(max(deadline - time.monotonic(), 0))
    finished = True
  except subprocess.TimeoutExpired:
    finished = False
  finally:
    if process.poll() is None:
      os.killpg(process.pid, signal.SIGKILL)
      process.wait()
    process.stdout.close()
  return output.decode("utf-8", "replace"), finished


def _processes(limit: int, namespaces: bool) -> int:
  """RLIMIT_NPROC for the worker: counted per user, so without a user namespace of its own the
  worker's user already runs some processes; those are added to the allowance."""
  if namespaces:
    return limit
  uid = os.getuid()
  return limit + sum(1 for name in os.listdir("/proc") if name.isdigit() and _owner(name) == uid)


def _owner(pid: str) -> int:
  try:
    return os.stat(f"/proc/{pid}").st_uid
  except FileNotFoundError:
    return -1
