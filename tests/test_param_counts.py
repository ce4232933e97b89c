"""Real-size parameter counts from abstract shapes (nothing is allocated)."""

import math

import jax
import pytest

from dlm_jax import model
from dlm_jax.config import preset


@pytest.mark.parametrize("name, expected", [
    ("llada-8b", 8_015_581_184),
    ("mmada-8b", 8_082_690_048),
    ("dream-7b", 7_615_616_512),
    ("llama3-8b", 8_030_261_248),
    ("qwen2.5-7b", 7_615_616_512),
])
def test_real_presets_have_the_published_parameter_counts(name, expected):
  abstract = model.abstract_params(preset(name))
  leaves = jax.tree.leaves(abstract)
  assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves)
  assert sum(math.prod(leaf.shape) for leaf in leaves) == expected
  assert model.param_count(preset(name)) == expected


@pytest.mark.parametrize("name, expected, published", [
    # Qwen3-0.6B (tied; the A2D, TIDE and AR ones share it): 0.596B, the 1.19 GB bf16 file of Qwen3-0.6B-Base
    # (small_dlms.md §2.3; the instruct and A2D files store the head twice, hence their 1.5 GB / "0.8B").
    ("qwen3-0.6b", 596_049_920, (1.19e9, 2, 3)),
    ("qwen3-0.6b-a2d-mdlm", 596_049_920, (1.19e9, 2, 3)),
    ("qwen3-0.6b-a2d-bd3lm", 596_049_920, (1.19e9, 2, 3)),
    ("tide-0.6b", 596_049_920, (1.19e9, 2, 3)),
    # SDAR-1.7B: its one 4.06 GB bf16 model.safetensors (§5.1).
    ("sdar-1.7b", 2_031_739_904, (4.06e9, 2, 3)),
    # SDAR-4B / 8B: model.safetensors.index.json total_size 8,822,848,512 / 16,381,470,720 bytes, bf16 (§5.2).
    ("sdar-4b", 4_411_424_256, (8_822_848_512, 2, 10)),
    ("sdar-8b", 8_190_735_360, (16_381_470_720, 2, 11)),
])
def test_qwen3_based_presets_match_their_published_file_sizes(name, expected, published):
  """published = (bytes of the hub's bf16 weights, bytes per parameter, significant digits given)."""
  file_bytes, per_param, digits = published
  count = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(model.abstract_params(preset(name))))
  assert count == expected
  scale = 10 ** (math.floor(math.log10(file_bytes)) - digits + 1)
  assert round(count * per_param / scale) * scale == file_bytes


def test_llada_shapes_follow_the_checkpoint_layout():
  shapes = jax.tree.map(lambda leaf: leaf.shape, model.abstract_params(preset("llada-8b")))
  assert shapes["embed"]["embedding"] == (126464, 4096)
  assert shapes["lm_head"]["kernel"] == (4096, 126464)
  assert shapes["blocks"]["attn"]["q"]["kernel"] == (32, 4096, 4096)
  assert shapes["blocks"]["mlp"]["down"]["kernel"] == (32, 12288, 4096)
  dream = jax.tree.map(lambda leaf: leaf.shape, model.abstract_params(preset("dream-7b")))
  assert dream["blocks"]["attn"]["k"]["bias"] == (28, 512)
  assert "lm_head" not in model.abstract_params(preset("smollm2-135m"))


def test_flat_names_round_trip():
  params = model.init_params(preset("tiny-dream"), jax.random.key(0))
  flat = model.flatten_params(params)
  assert "blocks.attn.q.bias" in flat and "embed.embedding" in flat
  restored = model.unflatten_params(flat)
  assert jax.tree.structure(restored) == jax.tree.structure(params)


@pytest.mark.parametrize("name, total, active, published", [
    # published = (total in billions, its rounding digits, active in billions, its digits, vocabulary
    # matrices the published active count includes).
    # LLaDA-MoE-7B-A1B: "1.4B active" (non-embedding + the LM head); the 14.7 GB bf16 checkpoint holds
    # 7.36B parameters = 16 x (4·2048² + QK norms + 2 norms + 2048·64 router + 64·3·2048·1024)
    # + 2·157184·2048 + 2048.
    ("llada-moe-7b", 7_356_880_896, 1_075_910_656, (7.36, 2, 1.4, 1, 1)),
    # LLaDA2.0-mini: "16B"; Ling-mini-2.0 quotes 0.79B non-embedding active parameters.
    ("llada2-mini", 16_255_643_392, 789_147_392, (16, 0, 0.79, 2, 0)),
    # LLaDA2.0-flash: "100BA6B" (active with both vocabulary matrices); its dimensions are UNVERIFIED
    # (Ling-flash-2.0 values from secondary sources).
    ("llada2-flash", 102_889_705_216, 4_864_626_432, (100, -1, 6, 0, 2)),
    # iLLaDA-8B: LLaDA-8B's shapes (UNVERIFIED beyond "runs with LLaDA's code"); dense, so active =
    # every non-embedding parameter.
    ("illada-8b", 8_015_581_184, 6_979_588_096, (8.0, 1, 7.0, 1, 0)),
])
def test_moe_presets_have_the_published_total_and_active_counts(name, total, active, published):
  config = preset(name)
  assert model.param_count(config) == total
  assert model.active_param_count(config) == active
  total_b, total_digits, active_b, active_digits, vocab_matrices = published
  assert round(total / 1e9, total_digits) == total_b
  with_vocab = active + vocab_matrices * config.vocab_size * config.d_model
  assert round(with_vocab / 1e9, active_digits) == active_b


def test_llada2_mini_shapes_put_the_dense_layer_in_its_own_stack():
  shapes = jax.tree.map(lambda leaf: leaf.shape, model.abstract_params(preset("llada2-mini")))
  assert shapes["dense_blocks"]["mlp"]["gate"]["kernel"] == (1, 2048, 5120)
  assert shapes["blocks"]["mlp"]["experts"]["gate"]["kernel"] == (19, 256, 2048, 512)
  assert shapes["blocks"]["mlp"]["experts"]["down"]["kernel"] == (19, 256, 512, 2048)
  assert shapes["blocks"]["mlp"]["router"]["score_bias"] == (19, 256)
  assert shapes["blocks"]["mlp"]["shared"]["up"]["kernel"] == (19, 2048, 512)
  assert shapes["blocks"]["attn"]["q_norm"]["weight"] == (19, 128)
  assert shapes["blocks"]["attn"]["k"]["kernel"] == (19, 2048, 512)


def test_diffusiongemma_preset_counts_the_text_stack():
  # DiffusionGemma 26B-A4B, text only. transformers 5.23 (DiffusionGemmaForBlockDiffusion on the meta
  # device, same text config) counts 25_250_986_752 decoder parameters (embedding, 30 layers, final norm,
  # self-conditioning; the encoder's text weights and lm_head are tied to them) plus 30 `layer_scalar`
  # buffers, which are parameters here: 25_250_986_782. The vision tower (169_527_296) is not converted.
  config = preset("diffusiongemma-26b-a4b")
  assert model.param_count(config) == 25_250_986_782
  shapes = jax.tree.map(lambda leaf: leaf.shape, model.abstract_params(config))
  assert shapes["blocks"]["attn"]["k"]["kernel"] == (25, 2816, 2048)
  assert shapes["global_blocks"]["attn"]["k"]["kernel"] == (5, 2816, 1024)
  assert "v" not in shapes["global_blocks"]["attn"]
  assert shapes["global_blocks"]["attn"]["q"]["kernel"] == (5, 2816, 8192)
  assert shapes["blocks"]["moe"]["experts"]["gate"]["kernel"] == (25, 128, 2816, 704)
  assert shapes["self_conditioning"]["mlp"]["gate"]["kernel"] == (2816, 2112)
  assert "lm_head" not in shapes
  assert model.active_param_count(config) == 3_102_178_078  # + the embedding matrix: 3.84B, "A4B"
