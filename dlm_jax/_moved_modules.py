"""The modules the layout step (commit 3eafbfc) moved, still importable from their old paths for one release.

`import dlm_jax.checkpoint` (or `from dlm_jax import checkpoint`, `from dlm_jax.stats import StatsSpec`) gives
a module that forwards every attribute to the new module(s) and warns once, at import, with a
`DeprecationWarning` naming the new path. No file exists at an old path: `MovedModuleFinder`, installed on
`sys.meta_path` by `dlm_jax/__init__.py`, answers for exactly the names in `MOVED`. The aliases go in the
next release; CHANGELOG.md lists the moves and BUILD.md ("Old import paths") says why.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings

MOVED: dict[str, tuple[str, ...]] = {
    "dlm_jax.checkpoint": ("dlm_jax.io.checkpoint",),
    "dlm_jax.tokenizer": ("dlm_jax.io.tokenizer",),
    "dlm_jax.stats": ("dlm_jax.instrument.stats", "dlm_jax.sampling.stats_plan"),
    "dlm_jax.interventions": ("dlm_jax.instrument.interventions",),
    "dlm_jax.likelihood": ("dlm_jax.analysis.likelihood",),
    "dlm_jax.routing": ("dlm_jax.analysis.routing",),
    "dlm_jax.sinks": ("dlm_jax.analysis.sinks",),
    "dlm_jax.attention": ("dlm_jax.model.attention",),
    "dlm_jax.rope": ("dlm_jax.model.rope",),
    "dlm_jax.distributed": ("dlm_jax.runtime.distributed",),
    "dlm_jax.sharding": ("dlm_jax.runtime.sharding",),
    "dlm_jax.xla_cpu": ("dlm_jax.runtime.xla_cpu",),
    "dlm_jax.training_data": ("dlm_jax.training.data",),
    "dlm_jax.train_loop": ("dlm_jax.training.loop",),
    "dlm_jax.training_uniform": ("dlm_jax.training.uniform",),
}
"""Old module path -> the module(s) its names live in now (dlm_jax.stats was split: the statistics spec in
instrument.stats, the planner in sampling.stats_plan)."""


class _ForwardingModule(types.ModuleType):
  """An old path: every attribute read from the new module(s), first one that has it."""

  def __init__(self, name: str, targets: tuple[str, ...]):
    super().__init__(name, f"Moved: import {' and '.join(targets)} instead (deprecated alias).")
    self._targets = targets

  def __getattr__(self, attribute: str):
    for target in self._targets:
      module = importlib.import_module(target)
      if hasattr(module, attribute):
        return getattr(module, attribute)
    raise AttributeError(f"module {self.__name__!r} (now {' and '.join(self._targets)}) has no attribute "
                         f"{attribute!r}")

  def __dir__(self):
    return sorted({name for target in self._targets for name in dir(importlib.import_module(target))})


class MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
  """Finds and loads the old paths of `MOVED` as forwarding modules, with a DeprecationWarning."""

  def find_spec(self, fullname, path=None, target=None):
    del path, target
    if fullname not in MOVED:
      return None
    return importlib.machinery.ModuleSpec(fullname, self)

  def create_module(self, spec):
    targets = MOVED[spec.name]
    warnings.warn(f"{spec.name} moved to {' and '.join(targets)}; import it from there (the old path is a "
                  "deprecated alias, removed in the next release; see CHANGELOG.md)", DeprecationWarning,
                  stacklevel=2)  # the import statement: warnings skips importlib's own frames
    for target in targets:
      importlib.import_module(target)
    return _ForwardingModule(spec.name, targets)

  def exec_module(self, module):
    del module


def install() -> None:
  """Puts one `MovedModuleFinder` at the end of `sys.meta_path` (only names no file answers reach it)."""
  if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
    sys.meta_path.append(MovedModuleFinder())
