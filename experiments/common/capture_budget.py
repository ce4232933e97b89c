"""--capture_budget_gb: the binaries that capture activations print what a capture plan needs and refuse a
plan over the budget before any model work."""

from __future__ import annotations

from absl import flags, logging

from dlm_jax.sampling.driver import capture_bytes
from experiments.common import flag_checks
from experiments.common.cli import UserError

_BUDGET = flags.DEFINE_float("capture_budget_gb", 4.0, "Most GiB the captured activations of one sampler call "
                             "may take (checked before running).")


def check(run, what: str, shrink: str) -> int:
  """Logs the bytes of run()'s captures (`capture_bytes`) and raises UserError (one line) when they pass
  --capture_budget_gb; `what` names the plan, `shrink` says how to make it smaller. Returns the bytes."""
  budget = _BUDGET.value
  flag_checks.above_zero(capture_budget_gb=budget)
  nbytes = capture_bytes(run)
  logging.info("capture plan %s: %.3f GiB per sampler call (budget %.3f GiB)", what, nbytes / 2**30, budget)
  print(f"capture plan {what}: {nbytes / 2**30:.4f} GiB per sampler call (--capture_budget_gb={budget:g})",
        flush=True)
  if nbytes > budget * 2**30:
    raise UserError(f"the capture plan {what} needs {nbytes / 2**30:.2f} GiB per sampler call, over "
                    f"--capture_budget_gb={budget:g}; {shrink}, or raise --capture_budget_gb")
  return nbytes
