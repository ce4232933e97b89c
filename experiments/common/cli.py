"""How every experiment binary starts and fails: `run(main)` instead of `absl.app.run(main)`.

A user error — a bad flag value, a missing or corrupt checkpoint, a bad config or mesh, an output path
that cannot be used, a malformed task file — is reported as one line on stderr,

  experiments.<binary>: error: <what is wrong and what was expected>

with exit code 1 and no traceback (`--verbose` prints the traceback too). The library's decoding-session errors
(`dlm_jax.session.SessionError`) are reported the same way. Usage errors (`UsageError`: a combination of flags
that does not make sense; the library's `CombinationError`) add a pointer to `--helpfull` instead of printing
the module docstring and every flag. Errors in flag parsing itself (an unknown flag, a bad value, a missing
required flag) take the same one-line form instead of absl's `FATAL Flags parsing error`.

Ctrl-C (KeyboardInterrupt) ends any binary with one line saying how to go on, exit code 130:

  experiments.<binary>: interrupted; <resume hint>

The hint is "nothing was written; run the same command again" unless the binary set another with
`set_resume_hint` (a run directory says its finished items are kept and the same command resumes).
"""

from __future__ import annotations

import math
import os
import re
import sys
import traceback
from typing import Callable, NoReturn

from absl import app, flags

from dlm_jax.extras import MissingExtra
from dlm_jax.runtime import backend_probe
from dlm_jax.io.checkpoint import CheckpointError
from dlm_jax.config import ConfigError
from dlm_jax.policy.base import PolicyError
from dlm_jax.session.errors import CombinationError, SessionError

_VERBOSE = flags.DEFINE_bool("verbose", False, "On an error, also print the Python traceback.")


class UserError(Exception):
  """A mistake in what the user asked for; the message names the thing and what was expected."""


class UsageError(UserError):
  """A flag combination that does not make sense (the message is followed by a pointer to --helpfull)."""


USER_ERRORS = (UserError, app.UsageError, CheckpointError, ConfigError, SessionError, PolicyError, FileNotFoundError,
               NotADirectoryError, IsADirectoryError, PermissionError, MissingExtra)
"""Exceptions `run` reports as one line: ours, the library's errors about checkpoints, configs, decoding
settings (`dlm_jax.session`), compute policies a run cannot take (`dlm_jax.policy.base.PolicyError`) and files,
and a missing extra (`dlm_jax.extras`)."""


DEFAULT_RESUME_HINT = "nothing was written; run the same command again"
_resume_hint = [DEFAULT_RESUME_HINT]
INTERRUPTED_EXIT_CODE = 130
_REQUIRED = re.compile(r"flag --(\w+)=None: Flag --\w+ must have a value other than None\.")


def set_resume_hint(hint: str) -> None:
  """What the Ctrl-C line says about going on (module docstring)."""
  _resume_hint[0] = hint


def program_name() -> str:
  """`experiments.<binary>` (or the script name) for error lines."""
  main = sys.modules.get("__main__")
  spec = getattr(main, "__spec__", None)
  if spec is not None and spec.name:
    return spec.name
  return os.path.basename(sys.argv[0]) if sys.argv else "experiments"


def report(error: BaseException) -> NoReturn:
  """Writes the one-line error (and the traceback with --verbose) to stderr and exits with code 1."""
  if flags.FLAGS.is_parsed() and _VERBOSE.value:
    traceback.print_exception(error, file=sys.stderr)
  message = " ".join(str(error).split()) or type(error).__name__
  if isinstance(error, (UsageError, app.UsageError, CombinationError)):
    message += " (see --helpfull)"
  print(f"{program_name()}: error: {message}", file=sys.stderr)
  sys.exit(1)


def flag_error_message(error: flags.Error) -> str:
  """absl's flag-parsing error as our wording ("--checkpoint is required" for missing required flags)."""
  text = " ".join(str(error).split())
  missing = _REQUIRED.findall(text)
  if not missing or _REQUIRED.sub("", text).strip():
    return text
  return f"--{' and --'.join(missing)} {'is' if len(missing) == 1 else 'are'} required"


def check_finite_floats() -> None:
  """Refuses nan or ±inf in any float flag given (absl parses them; no binary has a use for them)."""
  for name, flag in flags.FLAGS._flags().items():  # pylint: disable=protected-access
    value = flag.value
    if flag.present and isinstance(value, float) and not math.isfinite(value):
      raise UsageError(f"--{name}={value}: expected a finite number")


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parser with its errors reported as our one line (exit 1), not `FATAL Flags parsing error`."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as error:
    report(UsageError(flag_error_message(error)))


def interrupted() -> NoReturn:
  """Writes the one-line Ctrl-C message (module docstring) and exits with code 130."""
  print(f"{program_name()}: interrupted; {_resume_hint[0]}", file=sys.stderr)
  sys.exit(INTERRUPTED_EXIT_CODE)


def check_no_arguments(argv: list[str], allowed: int = 0) -> None:
  """Refuses positional arguments (every input is a flag) beyond the `allowed` first ones."""
  if len(argv) > 1 + allowed:
    raise UsageError(f"unexpected arguments {argv[1 + allowed:]}; every other input is a --flag")


def int_list(values: list[str], flag: str) -> tuple[int, ...]:
  """A list flag's values as integers (a one-line error naming --flag otherwise)."""
  try:
    return tuple(int(v) for v in values)
  except ValueError:
    raise UsageError(f"--{flag}={','.join(values)}: expected comma-separated integers") from None


def call(main: Callable[[list[str]], None], argv: list[str], arguments: int = 0) -> None:
  """Runs `main(argv)` (flags parsed), reporting a user error as one line and exit code 1; `arguments`
  positional arguments are allowed (the binary checks them); a nan or infinite float flag is refused."""
  try:
    check_finite_floats()
    check_no_arguments(argv, arguments)
    main(argv)
  except USER_ERRORS as error:
    report(error)
  except KeyboardInterrupt:
    interrupted()


def run(main: Callable[[list[str]], None], arguments: int = 0) -> None:
  """`absl.app.run(main)` with user errors, flag errors and Ctrl-C reported as one line (module docstring), and
  without JAX's start-up noise about backends that are not installed (`dlm_jax.runtime.backend_probe`)."""
  backend_probe.quiet_absent_backends()
  app.run(lambda argv: call(main, argv, arguments), flags_parser=parse_flags)
