"""How the experiment binaries decode: the decoding settings, their per-model values, the sampler options,
the model's own intervention and the sampler call.

Defaults of the experiment binaries (they differ from `experiments.generate`, which follows the official
signatures): gen_length = the training answer width of a model trained here, else 64; steps = gen_length;
block_length = 32 when gen_length is a larger multiple of 32, else gen_length / 4 (else gen_length);
Dream alg = entropy (Dream's README), not the generation config's origin. Block diffusion (block-causal
models, LLaDA2.x): blocks of the model's attention block, steps = the block length per block, LLaDA2's
rule (τ 0.95) or --decoding=threshold, EOS stop, exact KV cache. DiffusionGemma (uniform-state models):
one canvas of gen_length (--block_length sets canvases of that length), at most --steps (default 48)
decoder steps per canvas, and every other knob at `DiffusionGemmaGenerationConfig`'s default (entropy
bound 0.1, temperatures 0.8 → 0.4, adaptive stopping, EOS stop); --temperature does not apply to it. Which
rule a sampler follows is its block rule in the sampler registry (`dlm_jax.sampling.registry.BlockRule`:
divide, modes, attention, canvas, none), never its name.

Padding (--padding). Prompts of a run share one width (`experiments.common.prompts`); shorter ones are
left-padded. `invariant` (default): pad keys are hidden from every query and positions are shifted so
that each row's first real token is at position 0, so an item's results do not depend on how much it is
padded (LLaDA and MMaDA through `LLaDAOptions(padding="key", shift_positions=True)`; Dream and the ARMs
always shift; the library's statistics sum over the real queries only). `official`: the samplers' own behaviour — LLaDA
hides pad keys without shifting positions (the Oct-2025 HF code), MMaDA applies its outer-product mask
and none under CFG — so an item's results depend on the run's longest prompt. Pads that are visible prompt
tokens by design (a diffusion model in its training layout) are the same in both.

Confidence ranking (--confidence_ranking, LLaDA and MMaDA). `log_odds` (default): proposals are ranked by
log p − log(1 − p) computed from the logits, which does not saturate, so decode order is the one exact
arithmetic gives; `probability`: the originals' float probability, which is exactly 1 for many proposals of
a confident model, making the order a tie settled by position (`LLaDAOptions.confidence_ranking`). Dream,
block diffusion and DiffusionGemma keep their own confidences. `experiments.generate` follows the official
signatures (probability).

Decoding modes (--decoding, --threshold, --factor; `experiments.common.decoding_modes`): exact decoding (the
default), or Fast-dLLM's threshold / factor parallel decoding and prefix / dual KV caches, for the LLaDA,
MMaDA and Dream samplers (Dream then decodes in blocks of --block_length, default as above); the values
of a model record the mode.

PRNG keys. Each item's key is derived from --seed and the item's id (`item_key`), never from its batch:
every sampler call gets one key per row (`batch_key`; `dlm_jax.sampling.keys`).
"""

from __future__ import annotations

import dataclasses
import functools
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from dlm_jax.sampling import registry
from experiments.common import devices, size_limits
from experiments.common.checkpoints import Model
from experiments.common.cli import UserError
from experiments.common.decoding_modes import DecodingMode
from experiments.common import prompts as prompts_lib
from experiments.common.prompts import Prompts

REMASKING = ("low_confidence", "random")
CONFIDENCE_RANKINGS = ("log_odds", "probability")
DREAM_ALGS = ("origin", "maskgit_plus", "topk_margin", "entropy")
PADDINGS = ("invariant", "official")


@dataclasses.dataclass(frozen=True)
class DecodeSettings:
  """The decoding flags of the experiment binaries (None = the per-model default, module docstring)."""

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
        raise UserError(f"--{name}={value}: expected a positive integer (or leave it unset for the default)")
    size_limits.check(gen_length=self.gen_length, steps=self.steps, block_length=self.block_length, top_k=self.top_k)
    if self.temperature < 0:
      raise UserError(f"--temperature={self.temperature}: expected >= 0 (0 = argmax)")
    if self.cfg_scale < 0:
      raise UserError(f"--cfg_scale={self.cfg_scale}: expected >= 0 (0 = no guidance)")
    if self.top_p is not None and not 0 < self.top_p <= 1:
      raise UserError(f"--top_p={self.top_p}: expected a value in (0, 1]")
    if self.alg_temp is not None and self.alg_temp < 0:
      raise UserError(f"--alg_temp={self.alg_temp}: expected >= 0")
    if self.remasking not in REMASKING:
      raise UserError(f"--remasking={self.remasking}: expected one of {', '.join(REMASKING)}")
    if self.alg not in DREAM_ALGS:
      raise UserError(f"--alg={self.alg}: expected one of {', '.join(DREAM_ALGS)}")
    if self.padding not in PADDINGS:
      raise UserError(f"--padding={self.padding}: expected one of {', '.join(PADDINGS)}")
    if self.confidence_ranking not in CONFIDENCE_RANKINGS:
      raise UserError(f"--confidence_ranking={self.confidence_ranking}: expected one of "
                      f"{', '.join(CONFIDENCE_RANKINGS)}")


def _default_block(length: int) -> int:
  if length > 32 and length % 32 == 0:
    return 32
  return length // 4 if length % 4 == 0 else length


_RECORDED = ("cfg_scale", "remasking", "alg", "alg_temp", "top_p", "top_k")
"""The common settings other than the lengths and temperature that `DecodeSettings` holds: recorded for
each sampler that reads them."""


def model_settings(decode: DecodeSettings, model: Model, mode: DecodingMode = DecodingMode()) -> dict[str, Any]:
  """The decoding values used for `model` (defaults resolved) as a JSON-able dict; refuses values that do
  not fit together (block length not dividing gen_length, steps not a multiple of the blocks, a decoding
  mode the sampler does not have or a KV cache with guidance).

  The values: the sampler, gen_length, temperature (unless the sampler runs its own schedule), padding, the
  lengths of its block rule and the other common settings it reads (under its options' field names), LLaDA's
  confidence ranking, the decoding mode, its own schedule at its options' defaults and the autoregressive
  stop (`dlm_jax.sampling.registry`).

  mode: the --decoding mode (`experiments.common.decoding_modes`); diffusion samplers record it ("decoding" and
  the rule's "threshold" or "factor"), the autoregressive sampler, to which it does not apply, does not."""
  mode.option_fields(model.sampler)
  mode.check_tokenizer(model.tokenizer)
  sampler = model.decoder
  data = model.record.get("data", {})
  length = decode.gen_length
  if length is None:
    length = int(data["seq_len"]) - int(data["prompt_len"]) if data.get("seq_len") and data.get("prompt_len") else 64
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
  _check_fit(values, model, mode, decode.cfg_scale)
  return values


def _lengths(decode: DecodeSettings, model: Model, length: int, mode: DecodingMode) -> dict[str, int]:
  """steps and block_length (common setting names) of the sampler's block rule (`registry.BlockRule`;
  defaults: module docstring); refuses a block length other than the model's attention block."""
  sampler = model.decoder
  if sampler.blocks == "none":
    return {}
  if sampler.blocks == "attention":
    block = model.config.attention_block_size
    if decode.block_length not in (None, block):
      raise UserError(f"{model.label}: --block_length={decode.block_length} must be the model's attention block "
                      f"({block}) for block diffusion")
    return {"steps": decode.steps or block, "block_length": block}
  if sampler.blocks == "canvas":
    return {"steps": decode.steps or sampler.defaults.steps, "block_length": decode.block_length or length}
  lengths = {"steps": decode.steps or length}
  if sampler.blocks == "divide" or not mode.exact:
    lengths["block_length"] = decode.block_length or _default_block(length)
  return lengths


def _check_fit(values: dict[str, Any], model: Model, mode: DecodingMode, cfg_scale: float) -> None:
  """Refuses values that do not fit together: blocks that do not divide gen_length or steps that are not a
  multiple of their number (block rule divide), a KV cache with guidance, and what the options refuse of the
  blocks of a decoding mode (block rule modes) or of canvases (canvas)."""
  sampler = model.decoder
  if sampler.blocks == "divide":
    length, block, steps = values["gen_length"], values["block_length"], values["steps"]
    if length % block:
      raise UserError(f"{model.label}: --block_length={block} must divide --gen_length={length}")
    if steps % (length // block):
      raise UserError(f"{model.label}: --steps={steps} must be a multiple of the number of blocks "
                      f"gen_length / block_length = {length // block}")
  if "cfg_scale" in sampler.common_fields:
    mode.check_guidance(cfg_scale)
  if sampler.blocks == "canvas" or (sampler.blocks == "modes" and not mode.exact):
    try:
      sampler_options(values, padded=False)
    except ValueError as error:
      context = "" if sampler.blocks == "canvas" else f"--decoding={mode.decoding}: "
      raise UserError(f"{model.label}: {context}{error}") from None


def item_key_number(item_id: str) -> int:
  """A stable 31-bit number of an item id (its CRC-32), for seeding per-item randomness."""
  return zlib.crc32(item_id.encode("utf-8")) & 0x7FFFFFFF


def item_key(seed: int, item_id: str) -> jax.Array:
  """The PRNG key of one item: fold_in(key(seed), item_key_number(id))."""
  return jax.random.fold_in(jax.random.key(seed), item_key_number(item_id))


def batch_key(seed: int, item_ids: list[str]) -> jax.Array:
  """The key of a sampler call over rows holding `item_ids`: one `item_key` per row ([B] keys)."""
  numbers = jnp.asarray([item_key_number(i) for i in item_ids], jnp.uint32)
  return jax.vmap(lambda n: jax.random.fold_in(jax.random.key(seed), n))(numbers)


def _padding(padding: str, sampler: registry.Sampler) -> dict[str, Any]:
  """The options' padding fields of the --padding mode for a padded batch: the original's, or hidden pad keys
  with shifted positions (invariant)."""
  if padding == "official":
    return dict(sampler.official_padding)
  return {"padding": "key", "cfg_padding": True, "shift_positions": True}


def sampler_options(values: dict[str, Any], padded: bool, end_ids: tuple[int, ...] = ()):
  """The library options of the decoding `values` (`model_settings`; `dlm_jax.sampling.registry`); `padded`:
  a prompt mask is passed; `end_ids`: the ids that end an autoregressive row (empty = the config's EOS and
  EoT)."""
  sampler = registry.get(values["sampler"])
  common = registry.CommonSettings(**{name: values[field] for name, field in sampler.common_fields.items()
                                      if field in values})
  return sampler.options(common, **_own_fields(sampler, values, padded, end_ids))


def _own_fields(sampler: registry.Sampler, values: dict[str, Any], padded: bool,
                end_ids: tuple[int, ...]) -> dict[str, Any]:
  """The options fields of the values' sampler that are not common settings: the decoding mode's, LLaDA's
  confidence ranking and padding, DiffusionGemma's schedule, the autoregressive end ids."""
  fields = DecodingMode.from_record(values).option_fields(sampler.name)
  if "confidence_ranking" in sampler.fields:
    fields["confidence_ranking"] = values.get("confidence_ranking", "probability")
  if padded and sampler.official_padding:
    fields.update(_padding(values["padding"], sampler))
  fields.update({field: values[field] for field in sampler.schedule_fields})
  if "eos_token_ids" in sampler.fields:
    fields.update(stop_at_eos=True, eos_token_ids=tuple(sorted(end_ids)) or None)
  return fields


def base_intervention(model: Model):
  """The intervention every call of this model needs (the extra sink token), or None."""
  if model.sink_token == "none":
    return None
  from dlm_jax.instrument import interventions  # pylint: disable=import-outside-toplevel
  return interventions.SinkToken("front")


def combined_intervention(model: Model, intervention=None):
  """The model's own intervention (the extra sink token, if any) composed with `intervention` (first the
  sink token, then the other: a `Compose` whose state is (sink state, other state))."""
  from dlm_jax.instrument import interventions  # pylint: disable=import-outside-toplevel
  parts = [p for p in (base_intervention(model), intervention) if p is not None]
  if not parts:
    return interventions.NO_INTERVENTION
  return parts[0] if len(parts) == 1 else interventions.Compose(tuple(parts))


def check_finite(trace, rows: list[str] | None = None) -> None:
  """Refuses (a one-line `UserError` naming the row and the step) a `Trace` whose logits went NaN or
  infinite at some step (`Trace.first_nonfinite_step`, gathered from every process); rows: names of the
  batch rows."""
  from dlm_jax.runtime import distributed  # pylint: disable=import-outside-toplevel
  from dlm_jax.sampling.trace import nonfinite_message  # pylint: disable=import-outside-toplevel
  steps = trace.first_nonfinite_step
  if not isinstance(steps, np.ndarray):  # a device array, possibly sharded over processes
    steps = distributed.to_host(steps)
  message = nonfinite_message(steps, rows)
  if message is not None:
    raise UserError(message)


def masker_state(model: Model, intervention, masker, batch: int, total: int, k: int, valid):
  """Initial state of `intervention` (the masker alone, or `combined_intervention`'s Compose) with the
  masker's K = k and the valid keys [batch, total] bool eligible as sinks."""
  from dlm_jax.instrument import interventions  # pylint: disable=import-outside-toplevel
  state = intervention.init_state(model.config, batch, total)

  def set_k(s):
    return masker.with_top_k(s, k).replace(eligible=jnp.asarray(valid))

  if isinstance(intervention, interventions.Compose):
    return (state[0], set_k(state[1]))
  return set_k(state)


def sampler(model: Model, values: dict[str, Any], prompts: Prompts, runtime: devices.Runtime, numerics, *,
            key: jax.Array, stats_spec=None, intervention=None, intervention_state=None, params=None):
  """The model's sampler on a batch (placed on the mesh when there is one) with everything bound but its
  activation hooks: a function sample(hooks=..., hook_values=...) -> `Trace` (defaults: none), without the
  finiteness check of `generate` (so that `jax.eval_shape` can run it, e.g. `capture_budget.check`).

  values: `model_settings`; intervention: the complete intervention (see `combined_intervention`); None =
  the model's own; params: the weights (default the model's; e.g. abstract ones under `jax.eval_shape`)."""
  from dlm_jax.instrument.stats import NO_STATS  # pylint: disable=import-outside-toplevel
  if intervention is None:
    intervention = combined_intervention(model)
  prompt = devices.place_batch(prompts.ids, runtime)
  mask = None if prompts.mask is None else devices.place_batch(prompts.mask, runtime)
  if intervention_state is not None:
    intervention_state = devices.replicate(intervention_state, runtime)
  options = sampler_options(values, mask is not None, tuple(prompts_lib.end_ids(model)))
  kwargs = dict(config=model.config, options=options, key=key, prompt_mask=mask, stats_spec=stats_spec or NO_STATS,
                intervention=intervention, intervention_state=intervention_state,
                attention_impl=numerics.attention_impl, query_chunk=numerics.query_chunk,
                batch_invariant=numerics.batch_invariant)
  return functools.partial(model.decoder.generate, model.params if params is None else params, prompt, **kwargs)


def generate(model: Model, values: dict[str, Any], prompts: Prompts, runtime: devices.Runtime, numerics, *,
             key: jax.Array, stats_spec=None, intervention=None, intervention_state=None, hooks=None,
             hook_values=None):
  """Runs the model's sampler on a batch (`sampler`) with activation hooks if given (`dlm_jax.instrument`);
  returns the `Trace`, refused when its logits went non-finite (`check_finite`)."""
  from dlm_jax.instrument.hook_spec import NO_HOOKS  # pylint: disable=import-outside-toplevel
  trace = sampler(model, values, prompts, runtime, numerics, key=key, stats_spec=stats_spec,
                  intervention=intervention, intervention_state=intervention_state)(
                      hooks=NO_HOOKS if hooks is None else hooks, hook_values=hook_values)
  check_finite(trace, [f"{model.label} batch row {row}" for row in range(prompts.ids.shape[0])])
  return trace
