"""Where the suite's time goes: a recorder of JAX compilation events, cache misses and process times, used
only when `DLM_JAX_SUITE_PROFILE` names a directory (BUILD.md, "Test": "Measuring the suite").

Every process of a profiled run (the pytest workers and every subprocess they start, through
`sitecustomize.py` beside this file) appends JSON lines to `<dir>/<pid>.jsonl`:

- `{"kind": "start", "argv", "t"}` when the process starts (subprocesses only);
- `{"kind": "jax", "event", "secs", "fun", "key", "test", "t"}` for each tracing, lowering and backend
  compilation JAX reports (`key` is the persistent-cache key of a backend compilation that missed the cache,
  so a key compiled by two processes is the same program compiled twice);
- `{"kind": "cache_hit", "test", "t"}` for each program loaded from the persistent cache;
- `{"kind": "exit", "wall", "cpu", "first_trace_at", "first_trace_cpu", "test"}` at exit (subprocesses) —
  `first_trace_at` is the seconds from start to the first JAX trace (interpreter, imports, flag parsing, file
  reading), `first_trace_cpu` the process's CPU seconds by then;
- `{"kind": "test", "nodeid", "wall", "cpu", "children_cpu"}` per test (pytest workers, from conftest).

`test` is pytest's `PYTEST_CURRENT_TEST` (inherited by subprocesses), so every event is attributed to the
test and file that caused it. Recording adds a few microseconds per event and prints nothing.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import resource
import sys
import time

ENV = "DLM_JAX_SUITE_PROFILE"
_EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "compile",
}
_state = {"pending_key": None, "first_trace": None, "first_trace_cpu": None, "start": time.time(),
          "installed": False}


def write(record: dict) -> None:
  """Appends one JSON line to this process's file (opened per record: processes fork and exit abruptly)."""
  directory = os.environ.get(ENV)
  if not directory:
    return
  record.setdefault("t", time.time())
  with open(os.path.join(directory, f"{os.getpid()}.jsonl"), "a", encoding="utf-8") as f:
    f.write(json.dumps(record) + "\n")


def _current_test() -> str | None:
  return os.environ.get("PYTEST_CURRENT_TEST")


def _on_duration(event: str, secs: float, **kwargs) -> None:
  kind = _EVENTS.get(event)
  if kind is None:
    return
  if kind == "trace" and _state["first_trace"] is None:
    _state["first_trace"] = time.time() - _state["start"]
    _state["first_trace_cpu"] = cpu_seconds()
  key = None
  if kind == "compile":
    key, _state["pending_key"] = _state["pending_key"], None
  write({"kind": "jax", "event": kind, "secs": secs, "fun": str(kwargs.get("fun_name", "")), "key": key,
         "test": _current_test()})


def _on_event(event: str, **kwargs) -> None:
  if event == "/jax/compilation_cache/cache_hits":
    write({"kind": "cache_hit", "test": _current_test()})


class _CacheMissFilter(logging.Filter):
  """Reads the persistent-cache key from JAX's debug record of a miss and drops the records below the level
  the logger would otherwise show, so profiling prints nothing new."""

  def __init__(self, shown_level: int):
    super().__init__()
    self.shown_level = shown_level

  def filter(self, record: logging.LogRecord) -> bool:
    if record.msg.startswith("PERSISTENT COMPILATION CACHE MISS") and len(record.args) == 2:
      _state["pending_key"] = record.args[1]
    return record.levelno >= self.shown_level


def install_jax_listeners() -> None:
  """Registers the JAX listeners once; JAX must be importable (it is imported here)."""
  if _state["installed"]:
    return
  _state["installed"] = True
  from jax import monitoring  # noqa: PLC0415  (only when profiling)
  monitoring.register_event_duration_secs_listener(_on_duration)
  monitoring.register_event_listener(_on_event)
  compiler_logger = logging.getLogger("jax._src.compiler")
  shown = compiler_logger.getEffectiveLevel()
  compiler_logger.addFilter(_CacheMissFilter(shown))
  compiler_logger.setLevel(logging.DEBUG)


def cpu_seconds(who: int = resource.RUSAGE_SELF) -> float:
  usage = resource.getrusage(who)
  return usage.ru_utime + usage.ru_stime


def record_exit() -> None:
  write({"kind": "exit", "wall": time.time() - _state["start"], "cpu": cpu_seconds(),
         "first_trace_at": _state["first_trace"], "first_trace_cpu": _state["first_trace_cpu"],
         "test": _current_test(), "argv": sys.argv[:3]})


def start_subprocess_recording() -> None:
  """For a subprocess: record its start, its exit, and its JAX events once JAX is imported by the program
  (an import hook that removes itself, so a process that never imports JAX never pays for it)."""
  write({"kind": "start", "argv": sys.argv[:3], "test": _current_test()})
  atexit.register(record_exit)
  import builtins  # noqa: PLC0415
  original_import = builtins.__import__

  def importing(name, *args, **kwargs):
    module = original_import(name, *args, **kwargs)
    jax_module = sys.modules.get("jax")
    if jax_module is not None and getattr(jax_module, "jit", None) is not None:
      builtins.__import__ = original_import
      install_jax_listeners()
    return module

  builtins.__import__ = importing
