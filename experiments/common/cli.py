"""How every experiment binary starts and fails: `run(main)` instead of `absl.app.run(main)`.

A user error — a bad flag value, a missing or corrupt checkpoint, a bad config or mesh, an output path
that cannot be used, a malformed task file — is reported as one line on stderr,

  experiments.<binary>: error: <what is wrong and what was expected>

with exit code 1 and no traceback (`--verbose` prints the traceback too). Usage errors (`UsageError`:
a combination of flags that does not make sense) add a pointer to `--helpfull` instead of printing the
module docstring and every flag. Errors in flag parsing itself are absl's one line plus its pointer.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Callable

from absl import app, flags

from dlm_jax.io.checkpoint import CheckpointError
from dlm_jax.config import ConfigError

_VERBOSE = flags.DEFINE_bool("verbose", False, "On an error, also print the Python traceback.")


class UserError(Exception):
  """A mistake in what the user asked for; the message names the thing and what was expected."""


class UsageError(UserError):
  """A flag combination that does not make sense (the message is followed by a pointer to --helpfull)."""


USER_ERRORS = (UserError, app.UsageError, CheckpointError, ConfigError, FileNotFoundError, NotADirectoryError,
               IsADirectoryError, PermissionError)
"""Exceptions `run` reports as one line: ours, and the library's errors about checkpoints, configs and files."""


def program_name() -> str:
  """`experiments.<binary>` (or the script name) for error lines."""
  main = sys.modules.get("__main__")
  spec = getattr(main, "__spec__", None)
  if spec is not None and spec.name:
    return spec.name
  return os.path.basename(sys.argv[0]) if sys.argv else "experiments"


def report(error: BaseException) -> None:
  """Writes the one-line error (and the traceback with --verbose) to stderr and exits with code 1."""
  if flags.FLAGS.is_parsed() and _VERBOSE.value:
    traceback.print_exception(error, file=sys.stderr)
  message = " ".join(str(error).split()) or type(error).__name__
  if isinstance(error, (UsageError, app.UsageError)):
    message += " (see --helpfull)"
  print(f"{program_name()}: error: {message}", file=sys.stderr)
  sys.exit(1)


def check_no_arguments(argv: list[str]) -> None:
  """Refuses positional arguments (every input is a flag)."""
  if len(argv) > 1:
    raise UsageError(f"unexpected arguments {argv[1:]}; every input is a --flag")


def int_list(values: list[str], flag: str) -> tuple[int, ...]:
  """A list flag's values as integers (a one-line error naming --flag otherwise)."""
  try:
    return tuple(int(v) for v in values)
  except ValueError:
    raise UsageError(f"--{flag}={','.join(values)}: expected comma-separated integers") from None


def call(main: Callable[[list[str]], None], argv: list[str]) -> None:
  """Runs `main(argv)` (flags parsed), reporting a user error as one line and exit code 1."""
  try:
    check_no_arguments(argv)
    main(argv)
  except USER_ERRORS as error:
    report(error)


def run(main: Callable[[list[str]], None]) -> None:
  """`absl.app.run(main)` with user errors reported as one line (module docstring)."""
  app.run(lambda argv: call(main, argv))
