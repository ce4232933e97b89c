"""The decoding settings of a session and their per-model values: what the analysis binaries, the lm-eval
model and the benchmarks decode with.

Defaults (they differ from `experiments.generate`, which follows the official signatures): gen_length = the
training answer width of a model trained here, else 64; steps = gen_length; block_length = 32 when gen_length
is a larger multiple of 32, else gen_length / 4 (else gen_length); Dream alg = entropy (Dream's README), not
the generation config's origin. Block diffusion (block-causal models, LLaDA2.x): blocks of the model's
attention block, steps = the block length per block, LLaDA2's rule (τ 0.95) or --decoding=threshold, EOS
stop, exact KV cache. DiffusionGemma (uniform-state models): one canvas of gen_length (--block_length sets
canvases of that length), at most --steps (default 48) decoder steps per canvas, and every other knob at
`DiffusionGemmaGenerationConfig`'s default (entropy bound 0.1, temperatures 0.8 → 0.4, adaptive stopping, EOS
stop); --temperature does not apply to it. Which rule a sampler follows is its block rule in the sampler
registry (`dlm_jax.sampling.registry.BlockRule`: divide, modes, attention, canvas, none), never its name.

Padding (--padding). Prompts of a run share one width; shorter ones are left-padded. `invariant` (default):
pad keys are hidden from every query and positions are shifted so that each row's first real token is at
position 0, so an item's results do not depend on how much it is padded (LLaDA and MMaDA through
`LLaDAOptions(padding="key", shift_positions=True)`; Dream and the ARMs always shift; the library's statistics
sum over the real queries only). `official`: the samplers' own behaviour — LLaDA hides pad keys without
shifting positions (the Oct-2025 HF code), MMaDA applies its outer-product mask and none under CFG — so an
item's results depend on the run's longest prompt. Pads that are visible prompt tokens by design (a diffusion
model in its training layout) are the same in both.

Confidence ranking (--confidence_ranking, LLaDA and MMaDA). `log_odds` (default): proposals are ranked by
log p − log(1 − p) computed from the logits, which does not saturate, so decode order is the one exact
arithmetic gives; `probability`: the originals' float probability, which is exactly 1 for many proposals of
a confident model, making the order a tie settled by position (`LLaDAOptions.confidence_ranking`). Dream,
block diffusion and DiffusionGemma keep their own confidences.

Decoding modes (--decoding, --threshold, --factor; `dlm_jax.session.decoding_mode`): exact decoding (the
default), or Fast-dLLM's threshold / factor parallel decoding and prefix / dual KV caches, for the LLaDA,
MMaDA and Dream samplers (Dream then decodes in blocks of --block_length, default as above; KLASS's Dream code,
Dream's default --decoding=klass, and Elastic-Cache's Dream decoding, --window / --eos_truncation, without blocks:
`DecodingMode.whole_generation`); the values of a
model record the mode. The values become options through `dlm_jax.session.sampler_options`.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from absl import logging

from dlm_jax.sampling import dream, llada
from dlm_jax.session import sampler_options, size_limits, training_record
from dlm_jax.session.checkpoint_bundle import Model
from dlm_jax.session.decoding_mode import DecodingMode
from dlm_jax.session.errors import SessionError

REMASKING = typing.get_args(typing.get_type_hints(llada.LLaDAOptions)["remasking"])
"""LLaDA's remasking values (`LLaDAOptions.remasking`)."""
DREAM_ALGS = typing.get_args(typing.get_type_hints(dream.DreamOptions)["alg"])
"""Dream's alg values (`DreamOptions.alg`)."""
CONFIDENCE_RANKINGS = ("log_odds", "probability")
PADDINGS = ("invariant", "official")
DEFAULT_GEN_LENGTH = 64
"""gen_length of a model without a training record."""


@dataclasses.dataclass(frozen=True)
class DecodeSettings:
  """The decoding settings of a session (None = the per-model default, module docstring); the binaries' flags
  of the same names (`experiments.common.analysis_flags`), lm-eval's model_args and generation kwargs."""

  gen_length: int | None = None
  steps: int | None = None
  block_length: int | None = None
  temperature: float = 0.0
  cfg_scale: float = 0.0
  remasking: str = "low_confidence"
  alg: str = "entropy"
  alg_temp: float | None = None
  top_p: float | None = None
  top_k: int | None = None
  padding: str = "invariant"
  seed: int = 0
  confidence_ranking: str = "log_odds"

  def __post_init__(self):
    for name in ("gen_length", "steps", "block_length", "top_k"):
      value = getattr(self, name)
      if value is not None and value < 1:
        raise SessionError(f"--{name}={value}: expected a positive integer (or leave it unset for the default)")
    size_limits.check(gen_length=self.gen_length, steps=self.steps, block_length=self.block_length, top_k=self.top_k)
    if self.temperature < 0:
      raise SessionError(f"--temperature={self.temperature}: expected >= 0 (0 = argmax)")
    if self.cfg_scale < 0:
      raise SessionError(f"--cfg_scale={self.cfg_scale}: expected >= 0 (0 = no guidance)")
    if self.top_p is not None and not 0 < self.top_p <= 1:
      raise SessionError(f"--top_p={self.top_p}: expected a value in (0, 1]")
    if self.alg_temp is not None and self.alg_temp < 0:
      raise SessionError(f"--alg_temp={self.alg_temp}: expected >= 0")
    if self.remasking not in REMASKING:
      raise SessionError(f"--remasking={self.remasking}: expected one of {', '.join(REMASKING)}")
    if self.alg not in DREAM_ALGS:
      raise SessionError(f"--alg={self.alg}: expected one of {', '.join(DREAM_ALGS)}")
    if self.padding not in PADDINGS:
      raise SessionError(f"--padding={self.padding}: expected one of {', '.join(PADDINGS)}")
    if self.confidence_ranking not in CONFIDENCE_RANKINGS:
      raise SessionError(f"--confidence_ranking={self.confidence_ranking}: expected one of "
                         f"{', '.join(CONFIDENCE_RANKINGS)}")


def default_block(length: int) -> int:
  """The default block length of gen_length `length` (module docstring)."""
  if length > 32 and length % 32 == 0:
    return 32
  return length // 4 if length % 4 == 0 else length


_RECORDED = ("cfg_scale", "remasking", "alg", "alg_temp", "top_p", "top_k")
"""The common settings other than the lengths and temperature that `DecodeSettings` holds: recorded for
each sampler that reads them."""


def model_settings(decode: DecodeSettings, model: Model, mode: DecodingMode = DecodingMode()) -> dict[str, Any]:
  """The decoding values used for `model` (defaults resolved) as a JSON-able dict; refuses values that do
  not fit together (`sampler_options.check_fit`: block length not dividing gen_length, steps not a multiple
  of the blocks, a decoding mode the sampler does not have or a KV cache with guidance, what the options
  refuse of a mode's blocks or of canvases).

  The values: the sampler, gen_length, temperature (unless the sampler runs its own schedule), padding, the
  lengths of its block rule and the other common settings it reads (under its options' field names), LLaDA's
  confidence ranking, the decoding mode, its own schedule at its options' defaults and the autoregressive
  stop (`dlm_jax.sampling.registry`).

  mode: the --decoding mode; diffusion samplers record it ("decoding" and the rule's "threshold" or
  "factor"), the autoregressive sampler, to which it does not apply, does not."""
  mode.option_fields(model.sampler)
  mode.check_tokenizer(model.tokenizer)
  sampler = model.decoder
  length = decode.gen_length
  if length is None:
    length = training_record.answer_width(model.record) or DEFAULT_GEN_LENGTH
  values: dict[str, Any] = {"sampler": model.sampler, "gen_length": length}
  if sampler.temperature_schedule is None:
    values["temperature"] = decode.temperature
  elif decode.temperature:
    logging.warning("%s: --temperature does not apply to the %s sampler (its schedule runs from %s to %s); "
                    "ignored", model.label, model.sampler, *sampler.temperature_schedule)
  values["padding"] = decode.padding
  common = {**_lengths(decode, model, length, mode), **{name: getattr(decode, name) for name in _RECORDED}}
  values.update({field: common[name] for name, field in sampler.common_fields.items() if name in common})
  if "confidence_ranking" in sampler.fields:
    values["confidence_ranking"] = decode.confidence_ranking
  if sampler.has_modes:
    values.update(mode.record())
  defaults = {field.name: field.default for field in dataclasses.fields(sampler.options_class)}
  values.update({field: defaults[field] for field in sampler.schedule_fields})
  if "stop_at_eos" in sampler.fields:
    values["stop_at_eos"] = True
  sampler_options.check_values(values, mode, model.config, model.label, decode.cfg_scale)
  return values


def _lengths(decode: DecodeSettings, model: Model, length: int, mode: DecodingMode) -> dict[str, int]:
  """steps and block_length (common setting names) of the sampler's block rule (`registry.BlockRule`;
  defaults: module docstring); refuses a block length other than the model's attention block."""
  sampler = model.decoder
  if sampler.blocks == "none":
    return {}
  if sampler.blocks == "attention":
    block = sampler_options.attention_block(model.label, model.sampler, decode.block_length, model.config)
    return {"steps": decode.steps or block, "block_length": block}
  if sampler.blocks == "canvas":
    return {"steps": decode.steps or sampler.defaults.steps, "block_length": decode.block_length or length}
  lengths = {"steps": decode.steps or length}
  if mode.whole_generation(sampler.name):
    if decode.block_length is not None:
      lengths["block_length"] = decode.block_length  # refused by the options, with the model's label
  elif sampler.blocks == "divide" or not mode.exact:
    lengths["block_length"] = decode.block_length or default_block(length)
  return lengths
