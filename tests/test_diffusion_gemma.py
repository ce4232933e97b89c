"""DiffusionGemma (the Gemma-4 text stack as an encoder/decoder pair) against transformers 5.23.

A tiny random `DiffusionGemmaForBlockDiffusion` in float32 with sliding and global layers (two head dims
and kv-head counts, proportional RoPE, K = V), the dense GeGLU in parallel with the MoE, sandwich norms,
layer scalars and self-conditioning — every parameter and buffer randomised so that each one matters —
is written with `save_pretrained`, converted by `converters.hf_convert.convert` and compared on:
the encoder's logits over a causal prompt (lm_head on `encoder_last_hidden_state`), the decoder's logits
with the prompt cache, with and without self-conditioning logits, and the decoder's per-head attention
(eager attention weights of the reference, summed over queries) against our incoming-attention
statistics. The prompt and canvas are longer than the sliding window, so the window matters on both sides.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

from converters.hf_config import model_config
from converters.hf_convert import convert
from dlm_jax import model
from dlm_jax.io import checkpoint
from dlm_jax.io.checkpoint import CheckpointError
from dlm_jax.config import ConfigError, preset
from dlm_jax.instrument.stats import StatsSpec
from dlm_jax.model import CallInstruments, Compute

jax.config.update("jax_default_matmul_precision", "highest")

PROMPT, CANVAS, WINDOW = 7, 6, 4
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention"]
TOLERANCE = 1e-4
KEYS = PROMPT + 2 * CANVAS  # cache positions of every cached call (one size: one compiled program per call kind)
_forward = jax.jit(model.forward, static_argnames=("config", "stats_spec"))


def _hf_config() -> DiffusionGemmaConfig:
  text = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=5, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
              sliding_window=WINDOW, layer_types=LAYER_TYPES, num_experts=8, top_k_experts=2,
              moe_intermediate_size=32, max_position_embeddings=128)
  vision = dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=2, head_dim=8)
  return DiffusionGemmaConfig(text_config=text, vision_config=vision, canvas_length=CANVAS,
                              attn_implementation="eager")


def _randomize(reference: torch.nn.Module, seed: int = 0) -> None:
  """Every parameter random (norm-like weights 1 + 0.3·N(0, 1), router scales likewise, embeddings
  0.5·N(0, 1), other weights N(0, 1)/√fan_in); the layer scalars U(0.5, 1.5), the encoder's copy equal."""
  generator = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in reference.named_parameters():
      noise = torch.randn(p.shape, generator=generator)
      if name.endswith(("norm.weight", "router.scale", "per_expert_scale")):
        p.copy_(1.0 + 0.3 * noise)
      elif "embed_tokens" in name:
        p.copy_(0.5 * noise)
      else:
        p.copy_(noise / np.sqrt(p.shape[-1]))
    decoder_layers = reference.model.decoder.layers
    encoder_layers = reference.model.encoder.language_model.layers
    for dec, enc in zip(decoder_layers, encoder_layers):
      dec.layer_scalar.copy_(0.5 + torch.rand(dec.layer_scalar.shape, generator=generator))
      enc.layer_scalar.copy_(dec.layer_scalar)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
  """(reference model, our config, our params, prompt [2, P], canvas [2, T], HF directory)."""
  torch.manual_seed(0)
  reference = DiffusionGemmaForBlockDiffusion(_hf_config()).float().eval()
  _randomize(reference)
  hf_dir = str(tmp_path_factory.mktemp("dgemma_hf"))
  reference.save_pretrained(hf_dir)
  out_dir = str(tmp_path_factory.mktemp("dgemma_ours"))
  convert(hf_dir, out_dir, overwrite=True)
  config, params = checkpoint.load(out_dir, dtype=jnp.float32)
  rng = np.random.default_rng(0)
  prompt = rng.integers(0, 256, (2, PROMPT))
  canvas = rng.integers(0, 256, (2, CANVAS))
  return reference, config, params, prompt, canvas, hf_dir


def _softcapped_head(reference, hidden: torch.Tensor) -> np.ndarray:
  cap = reference.config.text_config.final_logit_softcapping
  with torch.no_grad():
    logits = reference.lm_head(hidden).float()
  return (torch.tanh(logits / cap) * cap).numpy()


def _reference(reference, prompt, canvas, sc_logits=None, attentions=False):
  with torch.no_grad():
    out = reference(input_ids=torch.tensor(prompt), decoder_input_ids=torch.tensor(canvas),
                    self_conditioning_logits=None if sc_logits is None else torch.tensor(sc_logits),
                    output_attentions=attentions)
  return out


def _ours(config, params, prompt, canvas, sc_logits=None, stats=None):
  b = prompt.shape[0]
  cache = model.KVCache.zeros(config, b, KEYS)  # spare slots after the canvas: unwritten keys must stay hidden
  encoder = _forward(params, jnp.asarray(prompt), config=config, cache=cache, cache_offset=0)
  decoder = _forward(params, jnp.asarray(canvas), config=config, cache=encoder.cache, cache_offset=PROMPT,
                          stats_spec=stats or StatsSpec(),
                          decoder=model.DecoderCall(None if sc_logits is None else jnp.asarray(sc_logits)))
  return encoder, decoder


def test_converted_config_matches_the_tiny_preset(converted):
  _, config, *_ = converted
  assert config.layer_pattern == "ssgsg"
  assert config.replace(name="tiny-diffusiongemma") == preset("tiny-diffusiongemma")


def test_encoder_logits_match(converted):
  reference, config, params, prompt, canvas, _ = converted
  expected = _softcapped_head(reference, _reference(reference, prompt, canvas).encoder_last_hidden_state)
  plain = np.asarray(_forward(params, jnp.asarray(prompt), config=config).logits)
  cached, _ = _ours(config, params, prompt, canvas)
  diff_plain = np.abs(plain - expected).max()
  diff_cached = np.abs(np.asarray(cached.logits) - expected).max()
  print(f"encoder logits max|diff|: {diff_plain:.2e} (no cache), {diff_cached:.2e} (filling the cache)")
  assert diff_plain <= TOLERANCE and diff_cached <= TOLERANCE


@pytest.mark.parametrize("self_conditioning", [False, True])
def test_decoder_logits_match(converted, self_conditioning):
  reference, config, params, prompt, canvas, _ = converted
  sc = None
  if self_conditioning:
    sc = (3.0 * np.random.default_rng(1).standard_normal((2, CANVAS, config.vocab_size))).astype(np.float32)
  expected = _reference(reference, prompt, canvas, sc).logits.numpy()
  _, decoder = _ours(config, params, prompt, canvas, sc)
  assert decoder.cache is None
  diff = np.abs(np.asarray(decoder.logits) - expected).max()
  print(f"decoder logits max|diff| (self-conditioning {'on' if self_conditioning else 'off'}): {diff:.2e}")
  assert diff <= TOLERANCE
  if self_conditioning:  # the signal matters: it changes the logits far beyond the tolerance
    _, without = _ours(config, params, prompt, canvas)
    assert np.abs(np.asarray(without.logits) - expected).max() > 100 * TOLERANCE


def test_decoder_incoming_attention_matches_the_reference_weights(converted):
  reference, config, params, prompt, canvas, _ = converted
  out = _reference(reference, prompt, canvas, attentions=True)
  _, decoder = _ours(config, params, prompt, canvas, stats=StatsSpec(incoming_attention=True, per_head=True))
  incoming = np.asarray(decoder.incoming_attention)  # [L, B, 1, N, S]
  n_keys = KEYS
  assert incoming.shape == (config.n_layers, 2, 1, config.n_heads, n_keys)
  np.testing.assert_allclose(incoming.sum(-1), CANVAS, rtol=1e-5)  # column sums of T rows that sum to one
  worst = 0.0
  for layer, kind in enumerate(config.layer_kinds):
    weights = out.attentions[layer].numpy()  # [B, N, T, kv]: the cached prompt keys, then the canvas
    first = PROMPT - (WINDOW - 1) if kind == "s" else 0
    assert weights.shape[-1] == PROMPT - first + CANVAS
    expected = np.zeros((2, config.n_heads, n_keys), np.float32)
    expected[..., first:PROMPT + CANVAS] = weights.sum(axis=2)
    worst = max(worst, np.abs(incoming[layer, :, 0] - expected).max())
  print(f"decoder incoming attention max|diff|: {worst:.2e}")
  assert worst <= TOLERANCE
  _, subset = _ours(config, params, prompt, canvas,
                   stats=StatsSpec(incoming_attention=True, per_head=True, layers=(1, 2)))
  np.testing.assert_allclose(np.asarray(subset.incoming_attention), incoming[1:3], atol=1e-5)


def test_second_canvas_matches_after_committing_the_first(converted):
  """The sampler's commit: the first canvas encoded causally after the prompt (the cache grows; sliding layers
  keep W−1 positions in transformers' cache, a window mask here), then the decoder over a second canvas."""
  from transformers import DynamicCache
  reference, config, params, prompt, canvas, _ = converted
  second = np.random.default_rng(2).integers(0, 256, (2, CANVAS))
  with torch.no_grad():
    cache = DynamicCache(config=reference.config.get_text_config(decoder=True))
    reference.model.encoder(input_ids=torch.tensor(prompt), past_key_values=cache)
    committed = reference.model.encoder(input_ids=torch.tensor(canvas), past_key_values=cache)
    expected_commit = _softcapped_head(reference, committed.last_hidden_state)
    positions = torch.arange(PROMPT + CANVAS, PROMPT + 2 * CANVAS)[None]  # as generate() passes them
    expected = reference(decoder_input_ids=torch.tensor(second), past_key_values=cache,
                         decoder_position_ids=positions).logits.numpy()
  ours = model.KVCache.zeros(config, 2, KEYS)
  ours = _forward(params, jnp.asarray(prompt), config=config, cache=ours, cache_offset=0).cache
  commit = _forward(params, jnp.asarray(canvas), config=config, cache=ours, cache_offset=PROMPT)
  decoder = _forward(params, jnp.asarray(second), config=config, cache=commit.cache, cache_offset=PROMPT + CANVAS,
                     decoder=model.DecoderCall())
  diff_commit = np.abs(np.asarray(commit.logits) - expected_commit).max()
  diff = np.abs(np.asarray(decoder.logits) - expected).max()
  print(f"second canvas: commit logits max|diff| {diff_commit:.2e}, decoder logits {diff:.2e}")
  assert diff_commit <= TOLERANCE and diff <= TOLERANCE


def test_different_layer_scalar_copies_are_refused(converted, tmp_path):
  reference, *_ = converted
  from safetensors.numpy import load_file, save_file
  hf_dir = converted[-1]
  tensors = load_file(os.path.join(hf_dir, "model.safetensors"))
  name = "model.encoder.language_model.layers.3.layer_scalar"
  tensors[name] = tensors[name] + 1.0
  bad = tmp_path / "bad"
  bad.mkdir()
  save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
  (bad / "config.json").write_text(open(os.path.join(hf_dir, "config.json")).read())
  with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
    convert(str(bad), str(tmp_path / "out"))
  del tensors[name]
  save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
  with pytest.raises(CheckpointError, match="missing tensor " + name.replace(".", r"\.")):
    convert(str(bad), str(tmp_path / "out"))


def test_bad_config_fields_are_named(converted):
  hf = json.load(open(os.path.join(converted[-1], "config.json")))
  broken = json.loads(json.dumps(hf))
  broken["text_config"]["rope_parameters"]["full_attention"]["rope_type"] = "yarn"
  with pytest.raises(ConfigError, match="rope_parameters.full_attention.rope_type"):
    model_config("auto", broken, "x")
  broken = json.loads(json.dumps(hf))
  broken["text_config"]["use_bidirectional_attention"] = "all"
  with pytest.raises(ConfigError, match="use_bidirectional_attention"):
    model_config("auto", broken, "x")
  broken = json.loads(json.dumps(hf))
  broken["text_config"]["per_layer_config"]["4"]["head_dim"] = 64
  with pytest.raises(ConfigError, match="per_layer_config"):
    model_config("auto", broken, "x")
  broken = json.loads(json.dumps(hf))
  del broken["text_config"]["layer_types"]
  with pytest.raises(ConfigError, match="layer_types"):
    model_config("auto", broken, "x")


def test_config_validation_names_the_field():
  base = preset("tiny-diffusiongemma")
  with pytest.raises(ConfigError, match="layer_pattern"):
    base.replace(layer_pattern="ssgs")
  with pytest.raises(ConfigError, match="global_head_dim"):
    base.replace(global_head_dim=None)
  with pytest.raises(ConfigError, match="sliding_window"):
    base.replace(sliding_window=None)
  with pytest.raises(ConfigError, match="moe_with_dense_mlp"):
    base.replace(sandwich_norms=False)
  with pytest.raises(ConfigError, match="sliding_window"):
    preset("tiny-llada").replace(sliding_window=8)


def test_decoder_needs_a_cache_and_self_conditioning_needs_a_self_conditioning_model():
  config = preset("tiny-diffusiongemma")
  params = model.abstract_params(config, jnp.float32)  # the checks come before any computation
  tokens = jnp.zeros((1, 3), jnp.int32)
  with pytest.raises(ValueError, match="cache"):
    model.forward(params, tokens, config=config, compute=Compute(decoder=model.DecoderCall()))
  with pytest.raises(ValueError, match="DecoderCall"):
    model.forward(params, tokens, config=config, compute=Compute(decoder=True))
  llada = preset("tiny-llada")
  with pytest.raises(ValueError, match="self_conditioning_logits"):
    model.forward(model.abstract_params(llada, jnp.float32), tokens, config=llada,
                  compute=Compute(cache=model.KVCache.zeros(llada, 1, 8), cache_offset=4,
                                  decoder=model.DecoderCall(jnp.zeros((1, 3, llada.vocab_size)))))
  with pytest.raises(ValueError, match="value_norms"):
    model.forward(params, tokens, config=config, instruments=CallInstruments(stats_spec=StatsSpec(value_norms=True)))


def test_every_parameter_has_logical_axes():
  flat = model.flatten_params(model.abstract_params(preset("tiny-diffusiongemma")))
  for name, leaf in flat.items():
    assert len(model.PARAM_AXES[name]) == leaf.ndim, name


def test_gemma_rmsnorm_in_bfloat16_matches_transformers():
  """norm_fp32_weight: the weight multiplies in float32 before the cast, as DiffusionGemmaRMSNorm does."""
  from transformers.models.diffusion_gemma.modeling_diffusion_gemma import DiffusionGemmaRMSNorm
  rng = np.random.default_rng(5)
  x = rng.standard_normal((3, 64)).astype(np.float32)
  w = (1 + 0.3 * rng.standard_normal(64)).astype(np.float32)
  reference = DiffusionGemmaRMSNorm(64, eps=1e-6).to(torch.bfloat16)
  with torch.no_grad():
    reference.weight.copy_(torch.tensor(w))
    expected = reference(torch.tensor(x).to(torch.bfloat16)).float().numpy()
  norm = model.RMSNorm(64, 1e-6, dtype=jnp.bfloat16, fp32_weight=True)
  norm.weight[...] = jnp.asarray(w, jnp.bfloat16)
  ours = np.asarray(norm(jnp.asarray(x, jnp.bfloat16)).astype(jnp.float32))
  np.testing.assert_array_equal(ours, expected)
