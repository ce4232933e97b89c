"""The seccomp filter confining signals (used where neither a PID namespace nor Landlock can): probed
with signal 0, which only checks whether a signal may be sent, in a separate process."""

import os
import subprocess
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PROBE = """
import ctypes, os, signal, sys, threading
from dlm_jax.tasks import sandbox_seccomp
parent = os.getppid()
os.setsid()
print(sandbox_seccomp.deny_signals_outside())
def allowed(send):
    try:
        send()
        return True
    except PermissionError:
        return False
print(allowed(lambda: os.kill(os.getpid(), 0)), allowed(lambda: os.kill(0, 0)), allowed(lambda: os.killpg(os.getpid(), 0)),
      allowed(lambda: signal.pthread_kill(threading.main_thread().ident, 0)))
print(allowed(lambda: os.kill(parent, 0)), allowed(lambda: os.kill(-1, 0)), allowed(lambda: os.killpg(os.getpgid(parent), 0)))
libc = ctypes.CDLL(None, use_errno=True)  # process_vm_readv of nothing: 0 if allowed
print(libc.process_vm_readv(os.getpid(), None, 0, None, 0, 0) == 0, libc.process_vm_readv(parent, None, 0, None, 0, 0) == 0,
      ctypes.get_errno() == 1)
child = os.fork()
if child == 0:
    print(allowed(lambda: os.kill(os.getppid(), 0)), allowed(lambda: os.kill(parent, 0)), flush=True)
    os._exit(0)
os.waitpid(child, 0)
"""


def test_signals_only_to_itself_and_its_group():
  done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=60, check=True,
                        cwd=_REPO, env={**os.environ, "PYTHONPATH": _REPO})
  lines = done.stdout.splitlines()
  if lines[0].startswith("seccomp: not applied"):
    import pytest  # pylint: disable=import-outside-toplevel
    pytest.skip(lines[0])
  assert lines[1:] == ["True True True True", "False False False", "False False True", "True False"], done.stdout
