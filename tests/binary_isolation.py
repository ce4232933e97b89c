"""Several binaries (`experiments.*`, `converters.*`, `benchmarks.*`) in one Python process, one after another.

Each binary defines its absl flags in the one global `flags.FLAGS` when imported, and two binaries define flags
of the same name, so a second import clashes. `forget_binaries()` deletes every flag defined by a module of
those packages and drops the modules from `sys.modules`; the next binary is then imported afresh, flags and
all, while the heavy imports (JAX, dlm_jax, NumPy) stay loaded: a subprocess start-up (about 1.3 CPU seconds
on a quiet machine, more under load) is paid once per test file instead of once per binary.

Used by the drivers of `tests/experiments_fixtures.py` and `tests/test_docs_commands.py`, which run in a
subprocess of their own (never in the pytest worker, whose test files hold their own binary modules).
"""

from __future__ import annotations

import sys

from absl import flags

PACKAGES = ("experiments", "converters", "benchmarks")


def _ours(module: str) -> bool:
  return module.split(".")[0] in PACKAGES


def forget_binaries() -> None:
  """Deletes the flags defined by every loaded module of PACKAGES (long and short names) and unloads those
  modules, so that importing any binary next defines its flags as in a fresh process."""
  values = flags.FLAGS
  for module, defined in list(values.flags_by_module_dict().items()):
    if not _ours(module):
      continue
    for flag in list(defined):
      for name in (flag.name, flag.short_name):
        if name and name in values and values[name] is flag:
          delattr(values, name)
  for module in [m for m in sys.modules if _ours(m)]:
    del sys.modules[module]
