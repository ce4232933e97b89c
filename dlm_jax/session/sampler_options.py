"""One resolver from a session's settings to a sampler's options: the common settings
(`dlm_jax.sampling.registry.CommonSettings`), the decoding mode (`dlm_jax.session.decoding_mode`) and the
sampler's block rule (`registry.BlockRule`) become the options its `generate` takes.

Every entry point resolves through `options`: `experiments.generate` (the official defaults and its own
sampler knobs), and the analysis binaries, the lm-eval model and the benchmarks through `from_values` (the
recorded values of `decode_settings.model_settings`). The block rule is applied here once:

  divide     LLaDA, MMaDA: block_length must divide gen_length and steps be a multiple of the blocks;
  modes      Dream: blocks only under a decoding mode (exact decoding has none); when a block length is given,
             the same fit as divide;
  attention  block diffusion: the block is the model's attention block (another value is refused);
  canvas     DiffusionGemma: canvases of block_length (the options check the fit);
  none       the autoregressive sampler.

`check_fit` refuses lengths that do not fit and a KV cache with guidance, with the settings' names, before
the options are built; the options classes check their own invariants again (`LLaDAOptions`, `DreamOptions`:
what a direct library caller gets), and `check_values` builds the options of a mode's blocks or of canvases to
have them refuse what only they know. Errors are `SessionError` (one line).
"""

from __future__ import annotations

from typing import Any

from dlm_jax.config import ModelConfig
from dlm_jax.sampling import registry
from dlm_jax.session.decoding_mode import DecodingMode
from dlm_jax.session.errors import SessionError

INVARIANT_PADDING = {"padding": "key", "cfg_padding": True, "shift_positions": True}
"""The options' padding fields of --padding=invariant: pad keys hidden, positions shifted."""


def _prefix(label: str) -> str:
  return f"{label}: " if label else ""


def attention_block(label: str, sampler: str, block_length: int | None, config: ModelConfig) -> int:
  """The block of a sampler whose block rule is attention: the model's attention block; refuses another
  block_length (None: unset, accepted)."""
  block = config.attention_block_size
  if block_length not in (None, block):
    raise SessionError(f"{_prefix(label)}--block_length={block_length} must be the model's attention block "
                       f"({block}) for {sampler}; leave it unset")
  return block


def check_fit(label: str, sampler: str, mode: DecodingMode, *, gen_length: int, steps: int | None,
              block_length: int | None, cfg_scale: float) -> None:
  """Refuses lengths that do not fit the sampler's block rule (divide and modes: block_length must divide
  gen_length, steps be a multiple of the number of blocks; nothing to check without a block length) and a KV
  cache with classifier-free guidance; label: the model's name in the message ("" for none)."""
  decoder = registry.get(sampler)
  if decoder.blocks in ("divide", "modes") and block_length is not None:
    if gen_length % block_length:
      raise SessionError(f"{_prefix(label)}--block_length={block_length} must divide --gen_length={gen_length} "
                         "(gen_length must be a multiple of block_length)")
    blocks = gen_length // block_length
    if steps is not None and steps % blocks:
      raise SessionError(f"{_prefix(label)}--steps={steps} must be a multiple of the number of blocks "
                         f"gen_length / block_length = {blocks}")
  if "cfg_scale" in decoder.common_fields:
    mode.check_guidance(cfg_scale)


def padding_fields(padding: str, sampler: registry.Sampler) -> dict[str, Any]:
  """The options' padding fields of the --padding mode for a padded batch: the original's (official), or
  hidden pad keys with shifted positions (invariant)."""
  if padding == "official":
    return dict(sampler.official_padding)
  return dict(INVARIANT_PADDING)


def options(sampler: str, common: registry.CommonSettings, mode: DecodingMode, own: dict[str, Any], *,
            config: ModelConfig, end_ids: tuple[int, ...] = (), stop_at_eos: bool = True,
            padding: str | None = None, label: str = ""):
  """The library options of `sampler`: the common settings it reads, the decoding mode's fields, `own` (its
  own variant, schedule and ranking fields), the block length of its block rule, the padding fields of a
  padded batch (padding: the --padding mode, None = no prompt mask) and the autoregressive stop (end_ids:
  the ids that end a row, empty = the config's EOS and EoT; none when not stop_at_eos)."""
  decoder = registry.get(sampler)
  fields = mode.option_fields(sampler)
  fields.update(own)
  if decoder.blocks == "modes" and mode.exact:
    fields["block_length"] = None  # exact decoding has no blocks
  if decoder.blocks == "attention":
    fields["block_length"] = attention_block(label, sampler, common.block_length, config)
  if padding is not None and decoder.official_padding:
    fields.update(padding_fields(padding, decoder))
  if "eos_token_ids" in decoder.fields:
    fields.update(stop_at_eos=stop_at_eos,
                  eos_token_ids=(tuple(sorted(end_ids)) or None) if stop_at_eos else None)
  return decoder.options(common, **fields)


def from_values(values: dict[str, Any], config: ModelConfig, padded: bool = False, end_ids: tuple[int, ...] = ()):
  """The options of recorded decoding `values` (`decode_settings.model_settings`); padded: a prompt mask is
  passed; end_ids: as `options`."""
  decoder = registry.get(values["sampler"])
  common = registry.CommonSettings(**{name: values[field] for name, field in decoder.common_fields.items()
                                      if field in values})
  own = {field: values[field] for field in decoder.schedule_fields}
  if "confidence_ranking" in decoder.fields:
    own["confidence_ranking"] = values.get("confidence_ranking", "probability")
  return options(decoder.name, common, DecodingMode.from_record(values), own, config=config, end_ids=end_ids,
                 padding=values["padding"] if padded else None)


def check_values(values: dict[str, Any], mode: DecodingMode, config: ModelConfig, label: str,
                 cfg_scale: float) -> None:
  """Refuses recorded `values` that do not fit together: `check_fit`, and what the options refuse of the
  blocks of a decoding mode (block rule modes) or of canvases (canvas)."""
  decoder = registry.get(values["sampler"])
  check_fit(label, decoder.name, mode, gen_length=values["gen_length"], steps=values.get("steps"),
            block_length=values.get("block_length"), cfg_scale=cfg_scale)
  if decoder.blocks == "canvas" or (decoder.blocks == "modes" and not mode.exact):
    try:
      from_values(values, config)
    except SessionError:
      raise
    except ValueError as error:
      context = "" if decoder.blocks == "canvas" else f"--decoding={mode.decoding}: "
      raise SessionError(f"{label}: {context}{error}") from None
