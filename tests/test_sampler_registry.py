"""The sampler registry (`dlm_jax.sampling.registry`): its facts agree with the samplers' options classes and
with the model rules written out here, and options built from common settings equal the options built by hand."""

import dataclasses

import pytest

from dlm_jax.config import PRESETS, preset
from dlm_jax.sampling import (AROptions, BlockDiffusionOptions, DiffusionGemmaOptions, DreamOptions, LLaDAOptions,
                              mmada_options, registry)

CALLER_GIVEN = {"gen_length", "steps", "block_length"}


def _fields(cls) -> dict[str, dataclasses.Field]:
  return {field.name: field for field in dataclasses.fields(cls)}


def _expected_default(config) -> str:
  if config.self_conditioning:
    return "diffusion_gemma"
  if config.causal:
    return "ar"
  if config.attention_block_size is not None:
    return "block_diffusion"
  return "dream" if config.logit_shift == 1 else "llada"


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_default_sampler_of_every_preset_follows_the_model_rules(name):
  config = preset(name)
  default = registry.default_for(config)
  assert default.name == _expected_default(config) and default.fits(config)


@pytest.mark.parametrize("name", registry.NAMES)
def test_facts_agree_with_the_options_class(name):
  sampler = registry.get(name)
  fields, common = _fields(sampler.options_class), _fields(registry.CommonSettings)
  assert set(sampler.common_fields) <= set(common) and set(sampler.common_fields.values()) <= set(fields)
  for setting, field in sampler.common_fields.items():
    if setting not in CALLER_GIVEN:  # a common default is the options class's own
      assert common[setting].default == fields[field].default, (setting, field)
  assert sampler.mode_fields <= set(fields)
  assert sampler.needs_mask_token == ("mask_token_id" in fields)
  assert sampler.self_conditioning == (sampler.kind == "self_conditioning")


def test_options_from_common_settings_equal_hand_built_ones():
  common = registry.CommonSettings(gen_length=16, steps=8, block_length=4, temperature=0.5, top_p=0.9, top_k=3,
                                   cfg_scale=1.0, remasking="random", alg="entropy", alg_temp=0.1, eps=1e-2)
  get = registry.get
  assert get("llada").options(common, threshold=0.9) == LLaDAOptions(
      gen_length=16, steps=8, block_length=4, temperature=0.5, cfg_scale=1.0, remasking="random", threshold=0.9)
  assert get("mmada").options(common) == mmada_options(gen_length=16, steps=8, block_length=4, temperature=0.5,
                                                       cfg_scale=1.0, remasking="random")
  assert get("dream").options(common, block_length=None) == DreamOptions(
      gen_length=16, steps=8, temperature=0.5, top_p=0.9, top_k=3, alg="entropy", alg_temp=0.1, eps=1e-2)
  assert get("ar").options(common, stop_at_eos=True) == AROptions(gen_length=16, temperature=0.5, top_p=0.9, top_k=3,
                                                                  stop_at_eos=True)
  assert get("block_diffusion").options(common) == BlockDiffusionOptions(
      gen_length=16, steps=8, block_length=4, temperature=0.5, top_p=0.9, top_k=3)
  assert get("diffusion_gemma").options(common) == DiffusionGemmaOptions(gen_length=16, canvas_length=4,
                                                                          max_denoising_steps=8)


def test_unknown_sampler_names_the_known_ones():
  with pytest.raises(ValueError, match="llada, mmada, dream, ar, block_diffusion, diffusion_gemma"):
    registry.get("maskgit")
