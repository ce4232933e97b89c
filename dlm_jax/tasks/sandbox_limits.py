"""Confinement a sandboxed process applies to itself before it runs untrusted code (see `sandbox`).

`apply(...)` sets resource limits with `resource.setrlimit`, drops every capability, and, where the
kernel has it, applies a Landlock domain (an unprivileged Linux security module, ABI v1 in Linux 5.13
up to v6+ in 6.12): writes only
beneath the work directory (and to /dev/null), reads only beneath the interpreter's own directories and
the system's shared libraries, no TCP bind or connect (ABI >= 4), and no signals to or abstract unix
sockets of processes outside the domain (ABI >= 6). It returns a line per confinement applied, for the
evaluator's report. Landlock cannot be lifted once applied, by root either, and is inherited by children.
Without a PID namespace and without Landlock's signal scope, `sandbox_seccomp` confines signals.
"""

from __future__ import annotations

import ctypes
import errno
import math
import os
import resource
import sys

from dlm_jax.tasks import sandbox_seccomp

_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446  # same numbers on every architecture
_PR_SET_NO_NEW_PRIVS = 38
_PR_CAPBSET_DROP, _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 24, 47, 4
_CAPABILITY_VERSION_3 = 0x20080522
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1

_EXECUTE, _WRITE_FILE, _READ_FILE, _READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_MAKE_AND_REMOVE = sum(1 << bit for bit in range(4, 13))  # remove dir/file, make char/dir/reg/sock/fifo/block/sym
_REFER, _TRUNCATE, _IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15  # ABI v2, v3, v5
_NET_BIND_TCP, _NET_CONNECT_TCP = 1 << 0, 1 << 1  # ABI v4
_SCOPE_ABSTRACT_UNIX_SOCKET, _SCOPE_SIGNAL = 1 << 0, 1 << 1  # ABI v6

_SYSTEM_READ_DIRS = ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/dev")
_SYSTEM_READ_FILES = ("/etc/ld.so.cache", "/etc/localtime")


class _RulesetAttr(ctypes.Structure):
  _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
              ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
  _pack_ = 1
  _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def apply(workdir: str, time_s: float, memory_bytes: int, file_bytes: int, processes: int,
          pid_namespace: bool) -> list[str]:
  """Limits this process (and what it starts) and returns a description line per confinement applied.

  pid_namespace: whether the process runs in a PID namespace of its own (the evaluator is then out of
  its reach); if not, and Landlock cannot scope signals, a seccomp filter does (`sandbox_seccomp`).
  """
  capabilities = _drop_capabilities()
  abi, landlock = _landlock(workdir)
  applied = [_rlimits(time_s, memory_bytes, file_bytes, processes), capabilities, landlock]
  if not pid_namespace and abi < 6:
    applied.append(sandbox_seccomp.deny_signals_outside())
  return applied


def _drop_capabilities() -> str:
  """Empties the capability sets (bounding, ambient, effective, permitted, inheritable): root, or root
  of a user namespace, keeps its uid but no privilege (no mounts, raw sockets, modules, reboot, ...)."""
  libc = ctypes.CDLL(None, use_errno=True)
  bounding = "emptied"
  for capability in range(64):
    if libc.prctl(_PR_CAPBSET_DROP, capability, 0, 0, 0) != 0:
      if ctypes.get_errno() != errno.EINVAL:  # EINVAL: past the last capability; EPERM: not allowed to drop
        bounding = "kept (no CAP_SETPCAP)"
      break
  libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
  header = (ctypes.c_uint32 * 2)(_CAPABILITY_VERSION_3, 0)
  data = (ctypes.c_uint32 * 6)()
  if libc.capset(ctypes.byref(header), ctypes.byref(data)) != 0:
    return f"capabilities: not dropped ({os.strerror(ctypes.get_errno())})"
  return f"capabilities: none (bounding set {bounding})"


def _rlimits(time_s: float, memory_bytes: int, file_bytes: int, processes: int) -> str:
  cpu = math.ceil(time_s) + 1
  for limit, value in ((resource.RLIMIT_AS, memory_bytes), (resource.RLIMIT_CPU, cpu),
                       (resource.RLIMIT_FSIZE, file_bytes), (resource.RLIMIT_NPROC, processes),
                       (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NOFILE, 256)):
    hard = resource.getrlimit(limit)[1]
    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
    resource.setrlimit(limit, (value, value))
  counted = "" if os.geteuid() != 0 else " (not enforced: root is exempt)"
  return (f"rlimits: address space {memory_bytes >> 20} MiB, CPU {cpu} s, file size {file_bytes >> 20} MiB, "
          f"processes {processes}{counted}")


def _landlock(workdir: str) -> tuple[int, str]:
  """Applies the strongest Landlock domain the kernel supports: (its ABI version or 0, a line saying
  what, or why nothing)."""
  libc = ctypes.CDLL(None, use_errno=True)
  abi = libc.syscall(_SYS_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION))
  if abi < 1:
    return 0, f"landlock: unavailable ({os.strerror(ctypes.get_errno())})"
  write = (_WRITE_FILE | _MAKE_AND_REMOVE | (_REFER if abi >= 2 else 0) | (_TRUNCATE if abi >= 3 else 0)
           | (_IOCTL_DEV if abi >= 5 else 0))
  read = _EXECUTE | _READ_FILE | _READ_DIR
  attr = _RulesetAttr(read | write, (_NET_BIND_TCP | _NET_CONNECT_TCP) if abi >= 4 else 0,
                      (_SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL) if abi >= 6 else 0)
  size = 8 if abi < 4 else 16 if abi < 6 else 24
  ruleset = libc.syscall(_SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
  if ruleset < 0:
    raise OSError(ctypes.get_errno(), "landlock_create_ruleset")
  try:
    file_rights = _EXECUTE | _READ_FILE | _WRITE_FILE | (_TRUNCATE if abi >= 3 else 0) | (
        _IOCTL_DEV if abi >= 5 else 0)
    _allow(libc, ruleset, workdir, read | write)
    _allow(libc, ruleset, os.devnull, file_rights)
    for path in _read_dirs():
      _allow(libc, ruleset, path, read)
    for path in _SYSTEM_READ_FILES:
      _allow(libc, ruleset, path, _READ_FILE)
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or libc.syscall(_SYS_RESTRICT_SELF, ruleset, 0) != 0:
      raise OSError(ctypes.get_errno(), "landlock_restrict_self")
  finally:
    os.close(ruleset)
  parts = ["writes only in the work directory", "reads only of the interpreter and system libraries"]
  parts += ["no TCP"] if abi >= 4 else []
  parts += ["no signals or abstract sockets outside"] if abi >= 6 else []
  return abi, f"landlock ABI {abi}: " + ", ".join(parts)


def _read_dirs() -> list[str]:
  """The interpreter's prefixes and import path, and the system library directories."""
  paths = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, *sys.path, *_SYSTEM_READ_DIRS]
  return sorted({os.path.realpath(p) for p in paths if p and os.path.isdir(p)})


def _allow(libc: ctypes.CDLL, ruleset: int, path: str, rights: int) -> None:
  """Allows `rights` beneath `path` (a directory, or just that file); a path that does not exist is skipped."""
  try:
    fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
  except FileNotFoundError:
    return
  try:
    rule = _PathBeneathAttr(rights, fd)
    if libc.syscall(_SYS_ADD_RULE, ruleset, _RULE_PATH_BENEATH, ctypes.byref(rule), ctypes.c_uint32(0)) != 0:
      raise OSError(ctypes.get_errno(), f"landlock_add_rule {path}")
  finally:
    os.close(fd)
