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


OWN_FIELDS = {  # each options class's fields beyond the sampler's common settings and mode fields
    "llada": {"logits_eos_inf", "confidence_eos_eot_inf", "padding", "shift_positions", "cfg_padding",
              "confidence_dtype", "confidence_ranking", "stop_token_id", "mask_token_id", "eos_token_id",
              "eot_token_id"},
    "dream": {"mask_token_id", "eos_token_id"},
    "ar": {"stop_at_eos", "eos_token_ids", "pad_token_id"},
    "block_diffusion": {"cache", "editing_threshold", "max_post_steps", "eos_stop", "mask_token_id", "eos_token_id"},
    "diffusion_gemma": {"entropy_bound", "t_min", "t_max", "stability_threshold", "confidence_threshold",
                        "eos_stop"},
}
OWN_FIELDS["mmada"] = OWN_FIELDS["llada"]
OFFICIAL = {  # (gen_length, steps, block_length): LLaDA's generate signature, Dream's generation config,
    # LLaDA2's generate (blocks: the model's), HF's DiffusionGemmaGenerationConfig
    "llada": (128, 128, 128), "mmada": (128, 128, 128), "dream": (512, 512, None), "ar": (128, None, None),
    "block_diffusion": (2048, 32, None), "diffusion_gemma": (256, 48, 256)}
BLOCKS = {"llada": "divide", "mmada": "divide", "dream": "modes", "ar": "none", "block_diffusion": "attention",
          "diffusion_gemma": "canvas"}
VARIANTS = {"llada": {"logits_eos_inf", "confidence_eos_eot_inf"}, "mmada": {"stop_token_id"},
            "block_diffusion": {"editing_threshold", "max_post_steps"}}
SCHEDULE = {"diffusion_gemma": {"entropy_bound", "t_min", "t_max", "confidence_threshold", "stability_threshold"}}
CHAT = {"llada": "llada", "mmada": "mmada", "dream": "dream", "ar": "llama3", "block_diffusion": "ling",
        "diffusion_gemma": None}


@pytest.mark.parametrize("name", registry.NAMES)
def test_defaults_and_own_settings_are_the_originals(name):
  sampler = registry.get(name)
  own = sampler.fields - set(sampler.common_fields.values()) - sampler.mode_fields
  assert own == OWN_FIELDS[name]
  assert set(sampler.variant_fields) == VARIANTS.get(name, set()) and set(sampler.schedule_fields) == SCHEDULE.get(
      name, set())
  assert set(sampler.variant_fields) | set(sampler.schedule_fields) <= own
  assert dataclasses.astuple(sampler.defaults) == OFFICIAL[name]
  assert sampler.blocks == BLOCKS[name] and sampler.chat_template == CHAT[name]
  for field in sampler.schedule_fields:  # the schedule's defaults are the options class's (HF's config)
    assert _fields(sampler.options_class)[field].default is not dataclasses.MISSING
  if sampler.defaults.steps is not None and sampler.blocks == "canvas":
    assert _fields(sampler.options_class)[sampler.common_fields["steps"]].default == sampler.defaults.steps


@pytest.mark.parametrize("name", registry.NAMES)
def test_temperature_and_padding_facts(name):
  sampler = registry.get(name)
  assert ("temperature" in sampler.common_fields) == (sampler.temperature_schedule is None)
  assert set(sampler.temperature_schedule or ()) <= set(sampler.schedule_fields)
  assert set(sampler.official_padding) <= sampler.fields
  assert bool(sampler.official_padding) == (name in ("llada", "mmada"))
  if name == "mmada":  # MMaDA's preset already is its original's padding
    assert all(getattr(sampler.make_options(), k) == v for k, v in sampler.official_padding.items())
