"""The sandbox for model-written code under attack: each hostile completion must leave the evaluator
alive, get the right verdict within a bounded time, and leak nothing. Each runs with and without
`unshare` namespaces (the other layers only), so the fallback is tested wherever the suite runs."""

import json
import os
import secrets
import socket
import subprocess
import sys
import time
import tracemalloc

import pytest

from dlm_jax.tasks import sandbox

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TEST = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"
_RIGHT = "def add(a, b):\n    return a + b\n"
_WRONG = "def add(a, b):\n    return a - b\n"
_FAST = sandbox.Limits(time_s=3.0)
_SLACK_S = 6.0  # start-up and teardown on a loaded machine; the failures guarded against hang or take minutes

pytestmark = pytest.mark.parametrize("namespaces", [None, False], ids=["auto", "no-namespaces"])


def _run(code: str, namespaces, limits: sandbox.Limits = _FAST) -> tuple[sandbox.Outcome, float]:
  start = time.monotonic()
  outcome = sandbox.run(code, _TEST, "add", limits, namespaces=namespaces)
  return outcome, time.monotonic() - start


def _has(outcome: sandbox.Outcome, prefix: str) -> bool:
  return any(line.startswith(prefix) for line in outcome.isolation)


def test_correct_incorrect_and_early_exit(namespaces):
  right, seconds = _run(_RIGHT, namespaces)
  assert right.status == "passed" and seconds < _FAST.time_s + _SLACK_S, right
  wrong, _ = _run(_WRONG, namespaces)
  assert wrong.status == "failed" and "AssertionError" in wrong.detail
  assert _run("import sys\nsys.exit(0)\n" + _RIGHT, namespaces)[0].status == "failed"
  assert _run("def add(a, b)\n    return a + b\n", namespaces)[0].status == "failed"
  # The test is compiled on its own: an unterminated string in the solution cannot swallow it.
  assert _run(_WRONG + "def check(candidate):\n    pass\n_ = '''", namespaces)[0].status == "failed"
  # Nor can replacing the builtins that compile and run it.
  for patch in (("real_compile = builtins.compile\n"
                 "builtins.compile = lambda *args, **kwargs: real_compile('def check(c):\\n    pass\\n', '<x>', 'exec')\n"),
                "builtins.exec = lambda code, namespace: namespace.update(check=lambda candidate: None)\n"):
    assert _run("import builtins\n" + patch + _WRONG, namespaces)[0].status == "failed"
  assert any(line.startswith("rlimits:") for line in right.isolation)


def _evaluate_in_subprocess(code: str, namespaces, env: dict[str, str]) -> tuple[sandbox.Outcome, float]:
  """Runs `sandbox.run` in a separate evaluator process (its own session, `env` in its initial
  environment), with `{me}` in `code` replaced by that process's pid: (its outcome, seconds)."""
  script = (
      "import json, os\n"
      "from dlm_jax.tasks import sandbox\n"
      f"code = {code!r}.replace('{{me}}', str(os.getpid()))\n"
      f"outcome = sandbox.run(code, {_TEST!r}, 'add', sandbox.Limits(time_s=3.0), namespaces={namespaces!r})\n"
      "print(json.dumps([outcome.status, outcome.detail, outcome.isolation]))\n")
  start = time.monotonic()
  done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False,
                        cwd=_REPO, env={**os.environ, **env, "PYTHONPATH": _REPO}, start_new_session=True)
  assert done.returncode == 0, done
  status, detail, isolation = json.loads(done.stdout)
  return sandbox.Outcome(status, detail, tuple(isolation)), time.monotonic() - start


def test_killing_the_evaluator_fails(namespaces):
  """The completion SIGKILLs the evaluator (by its pid and process group) and its own parent."""
  code = ("import os, signal\n"
          "for kill, pid in ((os.kill, {me}), (os.killpg, {me}), (os.kill, os.getppid())):\n"
          "    try:\n        kill(pid, signal.SIGKILL)\n    except OSError:\n        pass\n" + _RIGHT)
  isolation = _run(_RIGHT, namespaces)[0].isolation
  if not any(line.startswith(("namespaces: user, network (no interfaces up), PID", "seccomp: signals only"))
             or "no signals" in line for line in isolation):
    pytest.skip("no PID namespace, Landlock signal scope or seccomp filter here: the evaluator can be signalled")
  outcome, seconds = _evaluate_in_subprocess(code, namespaces, {})
  assert outcome.status == "passed" and seconds < 20


def test_the_evaluators_environment_is_not_visible(namespaces):
  """The completion looks for a secret of the evaluator's environment in its own environment and in
  every /proc/<pid>/environ it can read (the evaluator's pid included)."""
  secret = "s3cret-" + secrets.token_hex(8)
  code = (
      "import os\n"
      "found = [os.environ.get('DLM_TEST_SECRET', '')]\n"
      "try:\n"
      "    pids = os.listdir('/proc')\n"
      "except OSError:\n"
      "    pids = []\n"
      "for pid in pids + ['{me}']:\n"
      "    try:\n"
      "        found.append(open(f'/proc/{pid}/environ', 'rb').read().decode('latin-1'))\n"
      "    except OSError:\n"
      "        pass\n"
      "raise RuntimeError('leaked: ' + repr([f for f in found if 's3cret' in f]))\n")
  outcome, _ = _evaluate_in_subprocess(code, namespaces, {"DLM_TEST_SECRET": secret})
  if not (_has(outcome, "namespaces: user, network (no interfaces up), PID") or _has(outcome, "landlock ABI")):
    pytest.skip("neither a PID namespace nor Landlock here: /proc/<evaluator>/environ is readable")
  assert outcome.status == "failed" and "RuntimeError: leaked: []" in outcome.detail, outcome.detail
  assert secret not in outcome.detail


def test_fake_pass_by_exiting_zero_with_anything_it_can_read(namespaces):
  """A wrong completion prints and writes everything it can find (its argv, environment, files, every
  open descriptor) on every descriptor, then exits 0 before the tests."""
  code = (
      "import os, re, sys\n"
      "found = [repr(sys.argv).encode(), repr(os.environ).encode()]\n"
      "for name in ['/proc/self/cmdline', '/proc/self/environ', '/proc/1/cmdline', '/proc/1/environ',\n"
      "             *os.listdir('.')]:\n"
      "    try:\n"
      "        found.append(open(name, 'rb').read())\n"
      "    except OSError:\n"
      "        pass\n"
      "for fd in range(64):\n"
      "    try:\n"
      "        os.set_blocking(fd, False)\n"
      "        found.append(os.read(fd, 65536))\n"
      "    except OSError:\n"
      "        pass\n"
      "blob = b'\\n'.join(found)\n"
      "tokens = re.findall(rb'[0-9a-f]{32}|dlm-[\\w-]+', blob) or [b'']\n"
      "for fd in range(1, 64):\n"
      "    for token in tokens:\n"
      "        try:\n"
      "            os.write(fd, token)\n"
      "        except OSError:\n"
      "            pass\n"
      "os._exit(0)\n" + _WRONG)
  outcome, seconds = _run(code, namespaces)
  assert outcome.status == "failed" and "exited before the tests finished" in outcome.detail
  assert seconds < _FAST.time_s + _SLACK_S


def test_writes_outside_the_work_directory_are_refused(namespaces, tmp_path):
  targets = [str(tmp_path / "pwned"), f"/tmp/dlm-sandbox-escape-{secrets.token_hex(6)}",
             f"/var/tmp/dlm-sandbox-escape-{secrets.token_hex(6)}"]
  code = (
      "import os\n"
      "open('inside.txt', 'w').write('fine')\n"
      f"for path in {targets!r}:\n"
      "    try:\n"
      "        open(path, 'w').write('escaped')\n"
      "    except OSError:\n"
      "        pass\n"
      "print('workdir', os.getcwd())\n" + _RIGHT)
  try:
    outcome, _ = _run(code, namespaces)
    escaped = [path for path in targets if os.path.exists(path)]
  finally:
    for path in targets[1:]:
      if os.path.exists(path):
        os.remove(path)
  if not _has(outcome, "landlock ABI"):
    pytest.skip("no Landlock on this kernel: writes outside the work directory are not confined")
  assert outcome.status == "passed" and not escaped, (outcome, escaped)
  workdir = outcome.detail.split("workdir ", 1)[1].split()[0]
  assert workdir.startswith(os.path.realpath(os.environ.get("TMPDIR", "/tmp"))) and not os.path.exists(workdir)


def _alive_with(marker: str) -> list[str]:
  """Pids of processes whose command line contains `marker`."""
  found = []
  for pid in os.listdir("/proc"):
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        if marker.encode() in f.read():
          found.append(pid)
    except OSError:
      pass
  return found


@pytest.mark.parametrize("then", ["return", "hang"])
def test_setsid_grandchild_is_killed_and_not_waited_for(namespaces, then):
  """A double-forked, setsid() grandchild holding stdout sleeps far past the limit; the worker then
  returns (passes) or hangs (times out). Either way the evaluator returns at once and nothing is left."""
  marker = f"{900 + secrets.randbelow(99)}.{secrets.randbelow(10**6)}"
  code = (
      "import os\n"
      "if os.fork() == 0:\n"
      "    os.setsid()\n"
      "    if os.fork() == 0:\n"
      f"        os.execv('/bin/sleep', ['sleep', {marker!r}])\n"
      "    os._exit(0)\n"
      "os.wait()\n"
      + ("" if then == "return" else "while True:\n    pass\n") + _RIGHT)
  outcome, seconds = _run(code, namespaces, sandbox.Limits(time_s=1.5))
  assert outcome.status == ("passed" if then == "return" else "timed out"), outcome
  assert seconds < 1.5 + _SLACK_S
  assert not _alive_with(marker)


def test_memory_bomb_is_stopped(namespaces):
  outcome, seconds = _run("big = bytes(3 << 30)\n" + _RIGHT, namespaces,
                          sandbox.Limits(time_s=3.0, memory_bytes=512 << 20))
  assert outcome.status == "failed" and "MemoryError" in outcome.detail
  assert seconds < 3.0 + _SLACK_S


def test_output_flood_is_cut_without_buffering_it(namespaces):
  code = "import os\nchunk = b'x' * (1 << 20)\nfor _ in range(256):\n    os.write(1, chunk)\n" + _RIGHT
  tracemalloc.start()
  try:
    outcome, seconds = _run(code, namespaces, sandbox.Limits(time_s=5.0, output_bytes=1 << 20))
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert outcome.status == "failed" and "printed more than 1048576 bytes" in outcome.detail
  assert peak < 8 << 20 and seconds < 5.0 + _SLACK_S


def test_no_network(namespaces):
  """The completion connects to a port the evaluator listens on (loopback); nothing must arrive."""
  with socket.socket() as listener:
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.2)
    code = (
        "import socket\n"
        "try:\n"
        f"    socket.create_connection(('127.0.0.1', {listener.getsockname()[1]}), timeout=1).sendall(b'hi')\n"
        "except OSError:\n"
        "    pass\n" + _RIGHT)
    outcome, _ = _run(code, namespaces)
    if not (_has(outcome, "namespaces: user, network") or "no TCP" in " ".join(outcome.isolation)):
      pytest.skip("neither a network namespace nor Landlock TCP rules on this machine")
    assert outcome.status == "passed", outcome
    with pytest.raises(socket.timeout):
      listener.accept()


def test_fork_bomb_is_bounded(namespaces):
  """The completion forks 200 sleeping children; at most the process limit may exist, none after."""
  marker = f"{900 + secrets.randbelow(99)}.{secrets.randbelow(10**6)}"
  code = (
      "import os\n"
      "n = 0\n"
      "for _ in range(200):\n"
      "    try:\n"
      "        if os.fork() == 0:\n"
      f"            os.execv('/bin/sleep', ['sleep', {marker!r}])\n"
      "    except OSError:\n"
      "        break\n"
      "    n += 1\n"
      "raise RuntimeError(f'forked {n}')\n")
  outcome, seconds = _run(code, namespaces, sandbox.Limits(time_s=3.0, processes=16))
  if os.geteuid() == 0 and not _has(outcome, "pids cgroup"):
    pytest.skip("running as root (exempt from RLIMIT_NPROC) without a pids cgroup it can create")
  forked = int(outcome.detail.split("RuntimeError: forked ")[1].split()[0])
  assert outcome.status == "failed" and forked < 16 and seconds < 3.0 + _SLACK_S
  assert not _alive_with(marker)


def test_no_capabilities(namespaces):
  """Root (of the machine, or of the run's user namespace) keeps no privilege: no raw socket."""
  code = ("import socket\n"
          "try:\n"
          "    socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP).close()\n"
          "    raise RuntimeError('made a raw socket')\n"
          "except PermissionError:\n"
          "    pass\n" + _RIGHT)
  outcome, _ = _run(code, namespaces)
  assert outcome.status == "passed", outcome
