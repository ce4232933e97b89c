"""The task and decoding flags of sink_analysis, sink_masking_eval and value_norms, as `TaskSettings` and
`DecodeSettings`. Their defaults differ from `experiments.generate` (see `experiments.common.decoding`)."""

from __future__ import annotations

from absl import flags

from dlm_jax.session import decode_settings
from experiments.common import items

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
                             "padding (see experiments.common.decoding).")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed; each item's key is derived from it and the item's id.")
_CONFIDENCE_RANKING = flags.DEFINE_enum("confidence_ranking", "log_odds", list(decode_settings.CONFIDENCE_RANKINGS),
                                        "LLaDA/MMaDA: rank proposals by log odds (exact order) or by the "
                                        "originals' float probability (saturates at 1; ties by position).")


def task_from_flags() -> items.TaskSettings:
  return items.TaskSettings(samplers=tuple(_SAMPLERS.value), task=_TASK.value, data_seed=_DATA_SEED.value,
                            prompt_format=_PROMPT_FORMAT.value)


def decode_from_flags() -> decode_settings.DecodeSettings:
  return decode_settings.DecodeSettings(gen_length=_GEN_LENGTH.value, steps=_STEPS.value, block_length=_BLOCK_LENGTH.value,
                                 temperature=_TEMPERATURE.value, cfg_scale=_CFG_SCALE.value, remasking=_REMASKING.value,
                                 alg=_ALG.value, alg_temp=_ALG_TEMP.value, top_p=_TOP_P.value, top_k=_TOP_K.value,
                                 padding=_PADDING.value, seed=_SEED.value,
                                 confidence_ranking=_CONFIDENCE_RANKING.value)
