"""--output_dir, --overwrite and --max_items_this_run of the binaries that write a results directory."""

from __future__ import annotations

import dataclasses
import os

from absl import flags

from experiments.common import flag_checks
from experiments.common.cli import UserError

_OUTPUT_DIR = flags.DEFINE_string("output_dir", None, "Results directory (default: results/<binary name>).")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace an existing --output_dir (at the first result) "
                               "instead of resuming it.")
_MAX_ITEMS = flags.DEFINE_integer("max_items_this_run", 0, "Stop after writing this many result lines (0 = no "
                                  "limit; the next run resumes).")


@dataclasses.dataclass(frozen=True)
class OutputSettings:
  """Where results go and how much of the run to do now (none of it changes results)."""

  output_dir: str
  overwrite: bool = False
  max_items_this_run: int = 0

  def __post_init__(self):
    if self.max_items_this_run < 0:
      raise UserError(f"--max_items_this_run={self.max_items_this_run}: expected >= 0 (0 = no limit)")


def from_flags(default_name: str) -> OutputSettings:
  """The output flags; --output_dir defaults to results/<default_name> under the working directory (a blank one
  is refused)."""
  flag_checks.not_blank(output_dir=_OUTPUT_DIR.value)
  return OutputSettings(output_dir=os.path.abspath(_OUTPUT_DIR.value or os.path.join("results", default_name)),
                        overwrite=_OVERWRITE.value, max_items_this_run=_MAX_ITEMS.value)
