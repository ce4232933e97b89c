"""`python -m experiments.lm_eval ARGS`: lm-eval's own CLI with the `dlm_jax` model registered and this
package's local tasks (experiments/lm_eval/tasks) added to --include_path unless one is given. A bad
model_args value or checkpoint is one line on stderr and exit status 1 (the model_args of `--model dlm_jax`
are checked before lm-eval indexes its tasks)."""

from __future__ import annotations

import os
import sys

from dlm_jax import extras
from dlm_jax.runtime import backend_probe

TASKS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tasks")


def _flag(args: list[str], name: str) -> str | None:
  """The value of `name VALUE` or `name=VALUE` in args (None if absent)."""
  for index, arg in enumerate(args):
    if arg == name and index + 1 < len(args):
      return args[index + 1]
    if arg.startswith(name + "="):
      return arg[len(name) + 1:]
  return None


def main(argv: list[str]) -> int:
  extras.require("lm_eval", "eval", "experiments.lm_eval")
  backend_probe.quiet_absent_backends()
  from lm_eval.__main__ import cli_evaluate  # pylint: disable=import-outside-toplevel
  from experiments.common import cli  # pylint: disable=import-outside-toplevel
  from experiments.lm_eval import model  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import  (registers "dlm_jax")
  from lm_eval.utils import simple_parse_args_string  # pylint: disable=import-outside-toplevel
  from experiments.lm_eval import args as args_lib  # pylint: disable=import-outside-toplevel
  args = list(argv[1:])
  if args and args[0] not in ("ls", "validate") and not any(a.startswith("--include_path") for a in args):
    args += ["--include_path", TASKS_DIR]
  sys.argv = ["lm-eval"] + args
  try:
    if _flag(args, "--model") == "dlm_jax":
      args_lib.parse(simple_parse_args_string(_flag(args, "--model_args") or ""))
    cli_evaluate()
  except cli.USER_ERRORS as e:
    cli.report(e)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
