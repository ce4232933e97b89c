"""A seccomp filter that keeps a sandboxed process from signalling anything but itself and its own
process group, or tracing any process (see `sandbox`).

The sandbox's worker installs it when neither a PID namespace nor Landlock's signal scope (ABI 6,
Linux 6.12) protects the evaluator: without them a process of the same user could `kill` the evaluator
or, with `kill(-1, ...)`, every process of that user. Allowed: `kill` of the installing process's pid,
of 0 (the caller's own process group) or of minus that pid (the installer's group, which it leads
after `setsid`), `tgkill` / `rt_tgsigqueueinfo` within the installer's thread group, and
`rt_sigqueueinfo` to the installer. Refused with EPERM: every other target, `tkill`,
`pidfd_send_signal`, `pidfd_getfd`, `ptrace`, `process_vm_readv` / `writev`, and the x32 system-call
ABI. (Writing another process's memory through /proc/<pid>/mem is not a system call of its own:
Landlock, which hides /proc, or a PID namespace stops that.) Children inherit the filter with the
installer's pid: they may signal the worker and their own process group, but not themselves or their
siblings by pid, so a program that kills its own subprocesses by pid fails in this mode (the report
lists the filter).
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct

_PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 38, 22, 2
_LD_W_ABS, _JEQ_K, _JGE_K, _RET_K = 0x20, 0x15, 0x35, 0x06
_ALLOW, _EPERM = 0x7FFF0000, 0x00050000 | 1
_X32_BIT = 0x40000000
_PID_ARG = 16  # offsetof(struct seccomp_data, args[0]); the low 32 bits on little-endian machines
_ARCHES = {  # machine: (AUDIT_ARCH_*, kill, tkill, tgkill, rt_sigqueueinfo, rt_tgsigqueueinfo, refused outright:
    #           tkill, pidfd_send_signal, pidfd_getfd, ptrace, process_vm_readv, process_vm_writev)
    "x86_64": (0xC000003E, 62, 234, 129, 297, (200, 424, 438, 101, 310, 311)),
    "aarch64": (0xC00000B7, 129, 131, 138, 240, (130, 424, 438, 117, 270, 271)),
}


class _Program(ctypes.Structure):
  _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]


def deny_signals_outside() -> str:
  """Installs the filter in the calling process; a line saying so (or why not)."""
  machine = platform.machine()
  if machine not in _ARCHES:
    return f"seccomp: not applied (no system-call table for {machine})"
  arch, kill, tgkill, sigqueue, tgsigqueue, refused = _ARCHES[machine]
  code = _filter(arch, os.getpid(), kill, tgkill, sigqueue, tgsigqueue, refused)
  program = _Program(len(code) // 8, code)
  libc = ctypes.CDLL(None, use_errno=True)
  if (libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0
      or libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(program), 0, 0) != 0):
    return f"seccomp: not applied ({os.strerror(ctypes.get_errno())})"
  return "seccomp: signals only to the worker itself and its own process group; no ptrace"


def _filter(arch: int, pid: int, kill: int, tgkill: int, sigqueue: int, tgsigqueue: int,
            refused: tuple[int, ...]) -> bytes:
  """The classic-BPF program, as bytes of `struct sock_filter` (u16 code, u8 jt, u8 jf, u32 k)."""
  listing = [  # (code, k, jump if true, jump if false): labels, or None for the next instruction
      (_LD_W_ABS, 4, None, None),  # A = seccomp_data.arch
      (_JEQ_K, arch, None, "refuse"),
      (_LD_W_ABS, 0, None, None),  # A = seccomp_data.nr
      (_JGE_K, _X32_BIT, "refuse", None),
      (_JEQ_K, kill, "target", None),
      (_JEQ_K, sigqueue, "target", None),
      (_JEQ_K, tgkill, "thread group", None),
      (_JEQ_K, tgsigqueue, "thread group", None),
      *((_JEQ_K, number, "refuse", None) for number in refused),
      (_RET_K, _ALLOW, None, None),  # every other system call
      "target", (_LD_W_ABS, _PID_ARG, None, None),
      (_JEQ_K, pid, "allow", None),
      (_JEQ_K, 0, "allow", None),
      (_JEQ_K, (-pid) & 0xFFFFFFFF, "allow", "refuse"),
      "thread group", (_LD_W_ABS, _PID_ARG, None, None),
      (_JEQ_K, pid, "allow", "refuse"),
      "allow", (_RET_K, _ALLOW, None, None),
      "refuse", (_RET_K, _EPERM, None, None),
  ]
  instructions = [item for item in listing if isinstance(item, tuple)]
  labels, index = {}, 0
  for item in listing:
    if isinstance(item, str):
      labels[item] = index
    else:
      index += 1

  def offset(label: str | None, i: int) -> int:
    return 0 if label is None else labels[label] - (i + 1)  # BPF jumps only forward, relative to the next

  return b"".join(struct.pack("<HBBI", code, offset(jt, i), offset(jf, i), k)
                  for i, (code, k, jt, jf) in enumerate(instructions))
