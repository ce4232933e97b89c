"""The sandbox's own process tree (see `sandbox`): a supervisor and, forked from it, the worker that
runs the untrusted code.

The evaluator starts `python -I -c "...; sandbox_child.main(fd)"` (under `unshare` when it can) with a
JSON job on file descriptor `fd`: solution, test, entry_point, nonce, workdir and limits. The supervisor
reads and closes it, moves into the run's pids cgroup if the evaluator made one, mounts a size-limited
tmpfs on the work directory when it runs in its own mount namespace (never on the host's), makes itself
the reaper of every orphan below it (PR_SET_CHILD_SUBREAPER, so a `setsid()` grandchild cannot leave
the tree), forks the worker, and watches it: the time limit, output read incrementally with a cap, and
at the end (passed, failed, timed out or over the cap) SIGKILL to every descendant until none is left.
It then prints one JSON line for the evaluator: status, exit code, the tail of the output, what the
worker wrote on its result pipe (the confinement it applied, then the nonce or nothing), and whether
the cgroup and the tmpfs were set up.

The worker starts its own session, points stdout and stderr at the capped pipe, confines itself
(`sandbox_limits.apply`), writes the confinement report on the result pipe, and only then runs
untrusted code: the solution, compiled on its own; the test, compiled separately (no text in the
solution can swallow or rewrite it); `check(entry_point)`. The nonce goes on the result pipe only when
`check` returned. Neither the test source nor the nonce is ever in a file, the environment or argv.
"""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import json
import os
import selectors
import signal
import sys
import time
import traceback

from dlm_jax.tasks import sandbox_cgroup, sandbox_limits

_PR_SET_CHILD_SUBREAPER = 36
_MS_NOSUID, _MS_NODEV = 2, 4
_RESULT_FD = 3
_TAIL_BYTES = 4000
_RESULT_BYTES = 4096
_DRAIN_S = 1.0


def main(job_fd: int) -> None:
  """Supervisor entry point; prints the JSON report on stdout and exits 0."""
  with os.fdopen(job_fd, "rb") as f:
    job = json.loads(f.read())
  libc = ctypes.CDLL(None, use_errno=True)
  libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
  in_cgroup = bool(job["cgroup"]) and sandbox_cgroup.join(job["cgroup"])
  on_tmpfs = job["namespaces"] and libc.mount(b"tmpfs", job["workdir"].encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV,
                                              f"size={job['disk_bytes']},mode=0700".encode()) == 0
  out_r, out_w = os.pipe()
  result_r, result_w = os.pipe()
  sys.stdout.flush()
  pid = os.fork()
  if pid == 0:
    try:
      os.close(out_r)
      os.close(result_r)
      _worker(job, out_w, result_w)
    except BaseException:  # noqa: BLE001  # pylint: disable=broad-exception-caught
      traceback.print_exc()
      _flush()
    finally:
      os._exit(125)
  os.close(out_w)
  os.close(result_w)
  report = {**_supervise(pid, out_r, result_r, job), "cgroup": in_cgroup, "tmpfs": on_tmpfs}
  sys.stdout.write(json.dumps(report) + "\n")
  sys.stdout.flush()
  os._exit(0)


def _supervise(pid: int, out_r: int, result_r: int, job: dict) -> dict:
  """Waits for the worker within the time limit, reading its output with a cap; kills the whole tree."""
  pipes = _Pipes(out_r, result_r, job["output_bytes"])
  pidfd = os.pidfd_open(pid)
  pipes.selector.register(pidfd, selectors.EVENT_READ)
  deadline = time.monotonic() + job["time_s"]
  exit_code = None
  while exit_code is None and not pipes.over_cap and time.monotonic() < deadline:
    if pidfd in pipes.read_ready(deadline - time.monotonic()):
      exit_code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
  pipes.selector.unregister(pidfd)
  os.close(pidfd)
  _kill_descendants()
  drain_deadline = time.monotonic() + _DRAIN_S
  while pipes.selector.get_map() and not pipes.over_cap and time.monotonic() < drain_deadline:
    pipes.read_ready(drain_deadline - time.monotonic())
  status = "output limit" if pipes.over_cap else "timed out" if exit_code is None else "done"
  return {"status": status, "exit_code": exit_code, "output": pipes.output.decode("utf-8", "replace"),
          "result": pipes.result.decode("utf-8", "replace")}


class _Pipes:
  """The worker's output pipe (its tail kept, every byte counted against a cap) and result pipe (its
  first bytes kept), read as data arrives."""

  def __init__(self, out_r: int, result_r: int, cap: int):
    self.selector = selectors.DefaultSelector()
    self.selector.register(out_r, selectors.EVENT_READ)
    self.selector.register(result_r, selectors.EVENT_READ)
    self.out_r, self.result_r, self.cap = out_r, result_r, cap
    self.output, self.result, self.total = bytearray(), bytearray(), 0

  @property
  def over_cap(self) -> bool:
    return self.total > self.cap

  def read_ready(self, timeout: float) -> list[int]:
    """Reads every pipe that has data (unregistering those at EOF); the other ready descriptors."""
    others = []
    for key, _ in self.selector.select(max(timeout, 0)):
      if key.fd not in (self.out_r, self.result_r):
        others.append(key.fd)
        continue
      data = os.read(key.fd, 65536)
      if not data:
        self.selector.unregister(key.fd)
      elif key.fd == self.out_r:
        self.total += len(data)
        self.output += data
        del self.output[:-_TAIL_BYTES]
      else:
        self.result += data[:max(0, _RESULT_BYTES - len(self.result))]
    return others


def _kill_descendants() -> None:
  """SIGKILL to every child until none is left: orphans of killed children are re-parented to this
  process (a subreaper), so the loop reaches every descendant, whatever session it made."""
  me = os.getpid()
  while True:
    for child in _children(me):
      try:
        os.kill(child, signal.SIGKILL)
      except ProcessLookupError:
        pass
    try:
      while os.waitpid(-1, os.WNOHANG)[0]:
        pass
    except ChildProcessError:
      return
    time.sleep(0.002)


def _children(ppid: int) -> list[int]:
  """Processes whose parent is `ppid`, from /proc."""
  children = []
  for name in os.listdir("/proc"):
    if not name.isdigit():
      continue
    try:
      with open(f"/proc/{name}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
      continue
    if int(fields[1]) == ppid:
      children.append(int(name))
  return children


def _worker(job: dict, out_w: int, result_w: int) -> None:
  """Confines this process and runs the solution and its test; never returns."""
  os.setsid()
  os.dup2(out_w, 1)
  os.dup2(out_w, 2)
  os.dup2(result_w, _RESULT_FD)
  os.closerange(_RESULT_FD + 1, 1 << 16)
  write, exit_now = os.write, os._exit
  os.chdir(job["workdir"])
  os.umask(0o077)
  confinement = sandbox_limits.apply(job["workdir"], job["time_s"], job["memory_bytes"], job["file_bytes"],
                                     job["processes"], job["namespaces"])
  write(_RESULT_FD, (json.dumps(confinement) + "\n").encode())
  nonce, test, entry_point, solution = job["nonce"].encode(), job["test"], job["entry_point"], job["solution"]
  del job
  namespace = {"__name__": "__main__", "__builtins__": builtins}
  run = exec  # bound before untrusted code runs, as is the compiled test: patching builtins changes neither
  try:
    test_code = compile(test, "<test>", "exec")
    run(compile(solution, "<solution>", "exec"), namespace)
    run(test_code, namespace)
    namespace["check"](namespace[entry_point])
  except BaseException as e:  # noqa: BLE001  # pylint: disable=broad-exception-caught
    traceback.print_exception(type(e), e, e.__traceback__.tb_next)
    _flush()
    exit_now(1)
  _flush()
  write(_RESULT_FD, nonce)
  exit_now(0)


def _flush() -> None:
  """Flushes stdout and stderr, unless the program closed or replaced them."""
  for stream in (sys.stdout, sys.stderr):
    with contextlib.suppress(OSError, ValueError, AttributeError):
      stream.flush()
