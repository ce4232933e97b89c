"""The flags every model-analysis binary reads first — runtime (`devices`), task and decoding (defined here),
output (`output_flags`) and its own --checkpoints — as one `AnalysisFlags`.

The task and decoding flags (--samplers, --task, --data_seed, --prompt_format, --gen_length, --steps, ...) are
the analysis binaries' own: their defaults differ from `experiments.generate`, which defines its flags of the
same names with the official defaults (`dlm_jax.session.decode_settings`)."""

from __future__ import annotations

import dataclasses

from absl import flags

from dlm_jax.session import checkpoint_bundle, decode_settings
from dlm_jax.session.decode_settings import DecodeSettings
from experiments.common import runtime_flags, checkpoints, devices, items, output_flags
from experiments.common.devices import RuntimeSettings
from experiments.common.items import TaskSettings
from experiments.common.output_flags import OutputSettings


_SAMPLERS = flags.DEFINE_list("samplers", ["auto"], "Sampler per checkpoint (one value, or one per checkpoint): "
                              "auto (diffusion_gemma for DiffusionGemma-style models, ar for other causal models, "
                              "block_diffusion for block-causal ones, dream for shifted DLMs, llada otherwise), llada, "
                              "mmada, dream, ar, block_diffusion, diffusion_gemma.")
_TASK = flags.DEFINE_string("task", "auto", "synthetic, simple, humaneval, a GSM8K-format .jsonl path, or auto "
                            "(synthetic for models trained on it, else simple).")
_DATA_SEED = flags.DEFINE_integer("data_seed", 0, "Seed of the synthetic task generator.")
_PROMPT_FORMAT = flags.DEFINE_enum("prompt_format", "auto", list(items.PROMPT_FORMATS),
                                   "How questions become prompts (auto: the checkpoint's default, "
                                   "dlm_jax.io.prompt_layout: training when it records a training prompt width, "
                                   "else chat when it records a chat template, else plain).")
_GEN_LENGTH = flags.DEFINE_integer("gen_length", None, "Generated positions (default: the training answer width, "
                                   "else 64; experiments.generate defaults to 128).")
_STEPS = flags.DEFINE_integer("steps", None, "Diffusion steps (default: gen_length; experiments.generate "
                              "defaults to LLaDA's 128 and Dream's 512).")
_BLOCK_LENGTH = flags.DEFINE_integer("block_length", None, "LLaDA/MMaDA block length (default: 32 when gen_length "
                                     "is a larger multiple of 32, else gen_length / 4; experiments.generate "
                                     "defaults to LLaDA's 128).")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "Sampling temperature (0 = argmax; > 0 decodes one item "
                                  "per sampler call, with the item's own key).")
_CFG_SCALE = flags.DEFINE_float("cfg_scale", 0.0, "LLaDA/MMaDA classifier-free guidance weight.")
_REMASKING = flags.DEFINE_enum("remasking", "low_confidence", list(decode_settings.REMASKING), "LLaDA/MMaDA remasking.")
_ALG = flags.DEFINE_enum("alg", "entropy", list(decode_settings.DREAM_ALGS), "Dream alg (default entropy, as Dream's "
                         "README; experiments.generate defaults to the generation config's origin).")
_ALG_TEMP = flags.DEFINE_float("alg_temp", None, "Dream alg_temp.")
_TOP_P = flags.DEFINE_float("top_p", None, "Top-p filter in (0, 1] (Dream, ar).")
_TOP_K = flags.DEFINE_integer("top_k", None, "Top-k filter (Dream, ar).")
_PADDING = flags.DEFINE_enum("padding", "invariant", list(decode_settings.PADDINGS), "invariant: pads hidden and "
                             "positions shifted, results independent of padding; official: the samplers' own "
                             "padding (see dlm_jax.session.decode_settings).")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed; each item's key is derived from it and the item's id.")
_CONFIDENCE_RANKING = flags.DEFINE_enum("confidence_ranking", "log_odds", list(decode_settings.CONFIDENCE_RANKINGS),
                                        "LLaDA/MMaDA: rank proposals by log odds (exact order) or by the "
                                        "originals' float probability (saturates at 1; ties by position).")



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
  task = items.TaskSettings(samplers=tuple(_SAMPLERS.value), task=_TASK.value, data_seed=_DATA_SEED.value,
                            prompt_format=_PROMPT_FORMAT.value)
  decode = DecodeSettings(gen_length=_GEN_LENGTH.value, steps=_STEPS.value, block_length=_BLOCK_LENGTH.value,
                          temperature=_TEMPERATURE.value, cfg_scale=_CFG_SCALE.value, remasking=_REMASKING.value,
                          alg=_ALG.value, alg_temp=_ALG_TEMP.value, top_p=_TOP_P.value, top_k=_TOP_K.value,
                          padding=_PADDING.value, seed=_SEED.value, confidence_ranking=_CONFIDENCE_RANKING.value)
  return AnalysisFlags(runtime=runtime, task=task, decode=decode, output=output_flags.from_flags(binary),
                       checkpoints=tuple(checkpoints_flag.value))
