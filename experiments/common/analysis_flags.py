"""The flags every model-analysis binary reads first — runtime (`runtime_flags`), task and decoding
(`decode_flags`), output (`output_flags`) and its own --checkpoints — as one `AnalysisFlags`."""

from __future__ import annotations

import dataclasses

from absl import flags

from dlm_jax.session import checkpoint_bundle
from dlm_jax.session.decode_settings import DecodeSettings
from experiments.common import checkpoints, decode_flags, output_flags, runtime_flags
from experiments.common.devices import RuntimeSettings
from experiments.common.items import TaskSettings
from experiments.common.output_flags import OutputSettings


@dataclasses.dataclass(frozen=True)
class AnalysisFlags:
  """The shared flags of a model-analysis binary, each checked; `checkpoints` are the --checkpoints entries."""

  runtime: RuntimeSettings
  task: TaskSettings
  decode: DecodeSettings
  output: OutputSettings
  checkpoints: tuple[str, ...]

  def prepare_models(self) -> list[checkpoint_bundle.Model]:
    """The --checkpoints entries with their samplers and prompt format (`checkpoints.prepare_all`; no weights
    read yet)."""
    return checkpoints.prepare_all(self.checkpoints, self.task.samplers_for(self.checkpoints),
                                   self.task.prompt_format)


def from_flags(binary: str, checkpoints_flag: flags.FlagHolder) -> AnalysisFlags:
  """The shared flags, read in this order: runtime (which also applies --xla_cpu_options, the earliest point
  of the binary), task, decoding, output (--output_dir defaults to results/<binary>), then the binary's
  --checkpoints list flag."""
  runtime = runtime_flags.from_flags()
  task, decode = decode_flags.task_from_flags(), decode_flags.decode_from_flags()
  return AnalysisFlags(runtime=runtime, task=task, decode=decode, output=output_flags.from_flags(binary),
                       checkpoints=tuple(checkpoints_flag.value))
