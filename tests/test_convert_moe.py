"""LLaDA-MoE and LLaDA2.x checkpoints in their own Hugging Face layouts -> converters -> forward == reference.

The layouts follow models_2026.md §2.2 / §8.1 (LLaDA-MoE: the Llama names with per-expert tensors, the
router `mlp.gate`, per-head `q_norm`/`k_norm`, the layer's own `shared_expert`) and §3.2 / §8.2 (LLaDA2.x:
`model.word_embeddings`, the fused `attention.query_key_value`, `attention.dense`, `query_layernorm` /
`key_layernorm`, `mlp.gate.expert_bias`, `mlp.shared_experts`). The tensors come from transformers models
whose maths is the family's (float32, eager attention, explicit 4-D masks):
- LLaDA-MoE from Qwen3-MoE (softmax top-k without renormalisation, per-head QK norm, GQA, a leading dense
  layer), bidirectional;
- LLaDA2 from GLM-4-MoE (sigmoid group-limited router with a selection bias, renormalised and scaled, a
  shared expert, a leading dense layer, partial RoPE), its q/k/v fused here into LLaDA2's one
  projection, run with the block-causal mask of blocks of 32 on 40 tokens.
The test writes the family's config.json itself, with the fields of the hub files."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import save_file

from converters.hf_config import detect_arch
from converters.hf_convert import convert
from dlm_jax.io import checkpoint
from dlm_jax.io.checkpoint import CheckpointError
from dlm_jax.config import ConfigError
from dlm_jax.model import forward

try:
  from tests import hf_fixtures
  from tests.test_block_causal import block_causal_reference_mask
except ImportError:
  import hf_fixtures
  from test_block_causal import block_causal_reference_mask

TOLERANCE = 1e-4


def _state(reference) -> dict[str, np.ndarray]:
  return {k: v.detach().numpy().copy() for k, v in reference.state_dict().items()}


def _split_experts(sd: dict, layer: int, f: int, experts: int) -> dict:
  """One layer's stacked `mlp.experts.gate_up_proj` [E, 2F, D] / `down_proj` [E, D, F] as the per-expert
  tensors `mlp.experts.e.{gate,up,down}_proj.weight` of the LLaDA families."""
  prefix = f"model.layers.{layer}.mlp.experts."
  gate_up, down = sd.pop(prefix + "gate_up_proj"), sd.pop(prefix + "down_proj")
  out = {}
  for e in range(experts):
    out[f"{prefix}{e}.gate_proj.weight"] = gate_up[e, :f]
    out[f"{prefix}{e}.up_proj.weight"] = gate_up[e, f:]
    out[f"{prefix}{e}.down_proj.weight"] = down[e]
  return out


def _write(directory, config: dict, tensors: dict) -> None:
  directory.mkdir(parents=True, exist_ok=True)
  (directory / "config.json").write_text(json.dumps(config))
  save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(directory / "model.safetensors"))


LLADA_MOE = dict(d=48, layers=3, heads=4, kv_heads=2, head_dim=12, experts=8, k=3, f=20, dense_f=56, vocab=67)


def _qwen3_moe(seed=4):
  dims = LLADA_MOE
  hf_config = transformers.Qwen3MoeConfig(
      vocab_size=dims["vocab"], hidden_size=dims["d"], intermediate_size=dims["dense_f"],
      moe_intermediate_size=dims["f"], num_hidden_layers=dims["layers"], num_attention_heads=dims["heads"],
      num_key_value_heads=dims["kv_heads"], head_dim=dims["head_dim"], num_experts=dims["experts"],
      num_experts_per_tok=dims["k"], norm_topk_prob=False, mlp_only_layers=[0], decoder_sparse_step=1,
      rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 50000.0}, tie_word_embeddings=False,
      attn_implementation="eager", dtype=torch.float32)
  reference = transformers.Qwen3MoeForCausalLM(hf_config)
  hf_fixtures.randomize_parameters(reference, seed=seed)
  return reference.eval()


def llada_moe_checkpoint(directory, reference, **config_overrides):
  """The LLaDA-MoE hub layout of a Qwen3-MoE model: per-expert tensors, the 35 `LLaDAConfig` fields."""
  dims = LLADA_MOE
  sd = _state(reference)
  tensors = {}
  for name in list(sd):
    if ".mlp.experts." in name:
      continue
    tensors[name] = sd[name]
  for layer in range(1, dims["layers"]):
    tensors.update(_split_experts(sd, layer, dims["f"], dims["experts"]))
  config = {
      "architectures": ["LLaDAMoEModelLM"], "model_type": "llada", "vocab_size": dims["vocab"],
      "hidden_size": dims["d"], "dense_intermediate_size": dims["dense_f"], "expert_intermediate_size": dims["f"],
      "shared_expert_intermediate_size": None, "num_hidden_layers": dims["layers"],
      "num_attention_heads": dims["heads"], "num_key_value_heads": dims["kv_heads"], "hidden_act": "silu",
      "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "pad_token_id": 1, "eos_token_id": 1,
      "tie_word_embeddings": False, "rope_theta": 50000.0, "partial_rotary_factor": 1.0, "rope_scaling": None,
      "attention_bias": False, "clip_qkv": None, "num_experts_per_tok": dims["k"], "num_experts": dims["experts"],
      "router_aux_loss_coef": 0.01, "norm_topk_prob": True, "qk_layernorm": True, "moe_layer_freq": [0, 1, 1],
      "moe_router_enable_expert_bias": False, "moe_router_score_function": "softmax", "routed_scaling_factor": 1,
      "router_num_group": None, "router_topk_group": None, "head_dim": dims["head_dim"], "torch_dtype": "float32"}
  config.update(config_overrides)
  _write(directory, config, tensors)
  return tensors


LLADA2 = dict(d=48, layers=3, heads=4, kv_heads=2, head_dim=16, dense_f=56, experts=16, k=4, f=20, shared=1,
              groups=4, kept=2, scale=2.5, rotary=8, vocab=83)


def _glm4_moe(seed=11):
  dims = LLADA2
  hf_config = transformers.Glm4MoeConfig(
      vocab_size=dims["vocab"], hidden_size=dims["d"], intermediate_size=dims["dense_f"],
      moe_intermediate_size=dims["f"], num_hidden_layers=dims["layers"], num_attention_heads=dims["heads"],
      num_key_value_heads=dims["kv_heads"], head_dim=dims["head_dim"], n_routed_experts=dims["experts"],
      num_experts_per_tok=dims["k"], n_shared_experts=dims["shared"], first_k_dense_replace=1,
      n_group=dims["groups"], topk_group=dims["kept"], routed_scaling_factor=dims["scale"], norm_topk_prob=True,
      use_qk_norm=True, attention_bias=False, rms_norm_eps=1e-6, tie_word_embeddings=False,
      attn_implementation="eager", dtype=torch.float32,
      rope_parameters={"rope_type": "default", "rope_theta": 600000.0,
                       "partial_rotary_factor": dims["rotary"] / dims["head_dim"]})
  reference = transformers.Glm4MoeForCausalLM(hf_config)
  hf_fixtures.randomize_parameters(reference, seed=seed)
  generator = torch.Generator().manual_seed(seed + 1)
  with torch.no_grad():  # a selection bias that changes choices
    for layer in reference.model.layers[1:]:
      layer.mlp.gate.e_score_correction_bias.copy_(0.2 * torch.rand(dims["experts"], generator=generator))
  return reference.eval()


def llada2_checkpoint(directory, reference, drop_bias=False, **config_overrides):
  """The LLaDA2 hub layout of a GLM-4-MoE model: q/k/v fused into `attention.query_key_value`, the names of
  models_2026.md §3.2, the config.json keys of §8.2."""
  dims = LLADA2
  sd = _state(reference)
  tensors = {"model.word_embeddings.weight": sd.pop("model.embed_tokens.weight"),
             "model.norm.weight": sd.pop("model.norm.weight"), "lm_head.weight": sd.pop("lm_head.weight")}
  for layer in range(dims["layers"]):
    p = f"model.layers.{layer}."
    tensors[p + "attention.query_key_value.weight"] = np.concatenate(
        [sd.pop(p + f"self_attn.{x}_proj.weight") for x in "qkv"], axis=0)
    tensors[p + "attention.dense.weight"] = sd.pop(p + "self_attn.o_proj.weight")
    tensors[p + "attention.query_layernorm.weight"] = sd.pop(p + "self_attn.q_norm.weight")
    tensors[p + "attention.key_layernorm.weight"] = sd.pop(p + "self_attn.k_norm.weight")
    for norm in ("input_layernorm", "post_attention_layernorm"):
      tensors[p + norm + ".weight"] = sd.pop(p + norm + ".weight")
    if layer == 0:
      for x in ("gate", "up", "down"):
        tensors[p + f"mlp.{x}_proj.weight"] = sd.pop(p + f"mlp.{x}_proj.weight")
      continue
    tensors[p + "mlp.gate.weight"] = sd.pop(p + "mlp.gate.weight")
    bias = sd.pop(p + "mlp.gate.e_score_correction_bias")
    if not drop_bias:
      tensors[p + "mlp.gate.expert_bias"] = bias
    for x in ("gate", "up", "down"):
      tensors[p + f"mlp.shared_experts.{x}_proj.weight"] = sd.pop(p + f"mlp.shared_experts.{x}_proj.weight")
    tensors.update(_split_experts(sd, layer, dims["f"], dims["experts"]))
  assert not [k for k in sd if "inv_freq" not in k], sorted(sd)
  config = {
      "architectures": ["LLaDA2MoeModelLM"], "attention_dropout": 0.0, "dtype": "float32", "embedding_dropout": 0.0,
      "first_k_dense_replace": 1, "head_dim": dims["head_dim"], "hidden_act": "silu", "hidden_size": dims["d"],
      "initializer_range": 0.02, "intermediate_size": dims["dense_f"], "max_position_embeddings": 32768,
      "max_window_layers": 28, "model_type": "llada2_moe", "moe_intermediate_size": dims["f"],
      "moe_router_enable_expert_bias": True, "n_group": dims["groups"], "norm_head": False, "norm_softmax": False,
      "norm_topk_prob": True, "num_attention_heads": dims["heads"], "num_experts": dims["experts"],
      "num_experts_per_tok": dims["k"], "num_hidden_layers": dims["layers"], "num_key_value_heads": dims["kv_heads"],
      "num_shared_experts": dims["shared"], "output_dropout": 0.0, "output_router_logits": False,
      "pad_token_id": 1, "partial_rotary_factor": dims["rotary"] / dims["head_dim"], "rms_norm_eps": 1e-6,
      "rope_scaling": None, "rope_theta": 600000.0, "rotary_dim": dims["rotary"],
      "routed_scaling_factor": dims["scale"], "router_dtype": "fp32", "score_function": "sigmoid",
      "sliding_window": 4096, "tie_word_embeddings": False, "topk_group": dims["kept"], "use_bias": False,
      "use_cache": False, "use_qkv_bias": False, "vocab_size": dims["vocab"]}
  config.update(config_overrides)
  _write(directory, config, tensors)
  return tensors


def _reference_logits(reference, tokens, mask):
  with torch.no_grad():
    out = reference(input_ids=torch.tensor([tokens]), attention_mask=torch.tensor(mask)[None, None])
  return out.logits[0].numpy()


def _our_logits(directory, tokens):
  config, params = checkpoint.load(directory, dtype=jnp.float32)
  return config, np.asarray(forward(params, jnp.asarray([tokens]), config=config).logits[0])


@pytest.fixture(scope="module")
def qwen3_moe():
  return _qwen3_moe()


@pytest.fixture(scope="module")
def glm4_moe():
  return _glm4_moe()


def test_llada_moe_checkpoint_converts_and_matches_the_reference(tmp_path, qwen3_moe):
  llada_moe_checkpoint(tmp_path / "hf", qwen3_moe)
  assert detect_arch(json.loads((tmp_path / "hf" / "config.json").read_text())) == "llada-moe"
  config = convert(str(tmp_path / "hf"), str(tmp_path / "out"), dtype="float32")
  assert (config.n_experts, config.experts_per_token, config.first_k_dense, config.router) == (8, 3, 1, "softmax_topk")
  assert not config.router_renormalize and config.qk_norm and not config.causal and config.logit_shift == 0
  tokens = np.random.default_rng(2).integers(0, LLADA_MOE["vocab"], size=17).tolist()
  loaded, logits = _our_logits(tmp_path / "out", tokens)
  assert loaded == config
  reference = _reference_logits(qwen3_moe, tokens, np.zeros((17, 17), np.float32))
  np.testing.assert_allclose(logits, reference, atol=TOLERANCE, rtol=0)


def test_llada_moe_shared_expert_and_expert_bias_are_mapped(tmp_path, qwen3_moe):
  """The layer's `shared_expert` and `mlp.expert_bias` (moe_router_enable_expert_bias) land where the model
  reads them; the bias is added to the probabilities (checked on the router directly)."""
  dims = LLADA_MOE
  rng = np.random.default_rng(5)
  path = tmp_path / "hf"
  tensors = llada_moe_checkpoint(path, qwen3_moe, shared_expert_intermediate_size=12,
                                 moe_router_enable_expert_bias=True)
  for layer in (1, 2):
    p = f"model.layers.{layer}."
    tensors[p + "mlp.expert_bias"] = rng.normal(size=dims["experts"]).astype(np.float32) * 0.1
    tensors[p + "shared_expert.gate_proj.weight"] = rng.normal(size=(12, dims["d"])).astype(np.float32)
    tensors[p + "shared_expert.up_proj.weight"] = rng.normal(size=(12, dims["d"])).astype(np.float32)
    tensors[p + "shared_expert.down_proj.weight"] = rng.normal(size=(dims["d"], 12)).astype(np.float32)
  save_file(tensors, str(path / "model.safetensors"))
  config = convert(str(path), str(tmp_path / "out"), dtype="float32")
  assert config.router_expert_bias and (config.n_shared_experts, config.shared_expert_hidden) == (1, 12)
  _, params = checkpoint.load(tmp_path / "out", dtype=jnp.float32)
  mlp = params["blocks"]["mlp"]
  for i, layer in enumerate((1, 2)):
    p = f"model.layers.{layer}."
    np.testing.assert_array_equal(mlp["router"]["score_bias"][i], tensors[p + "mlp.expert_bias"])
    np.testing.assert_array_equal(mlp["shared"]["gate"]["kernel"][i], tensors[p + "shared_expert.gate_proj.weight"].T)
    np.testing.assert_array_equal(mlp["shared"]["down"]["kernel"][i], tensors[p + "shared_expert.down_proj.weight"].T)
    np.testing.assert_array_equal(mlp["experts"]["up"]["kernel"][i, 5], tensors[p + "mlp.experts.5.up_proj.weight"].T)
  from dlm_jax import model as model_lib
  x = jnp.asarray(rng.normal(size=(9, dims["d"])), jnp.float32)
  logits = np.asarray(x) @ np.asarray(mlp["router"]["kernel"][0])
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs = probs / probs.sum(-1, keepdims=True) + np.asarray(mlp["router"]["score_bias"][0])
  weights, experts = model_lib.route(config, jnp.asarray(logits), mlp["router"]["score_bias"][0])
  expected = np.sort(np.argsort(-probs, axis=-1)[:, :dims["k"]], axis=-1)
  np.testing.assert_array_equal(np.sort(np.asarray(experts), axis=-1), expected)
  np.testing.assert_allclose(np.asarray(weights), np.take_along_axis(probs, np.asarray(experts), -1), atol=1e-6)


@pytest.mark.parametrize("drop_bias", [False, True])
def test_llada2_checkpoint_converts_and_matches_the_block_causal_reference(tmp_path, glm4_moe, drop_bias):
  llada2_checkpoint(tmp_path / "hf", glm4_moe, drop_bias=drop_bias)
  config = convert(str(tmp_path / "hf"), str(tmp_path / "out"), dtype="float32")
  assert (config.attention_block_size, config.router, config.rotary_dim, config.first_k_dense) == (
      32, "sigmoid_group", 8, 1)
  assert config.router_renormalize and config.routed_scaling_factor == 2.5 and config.n_shared_experts == 1
  tokens = np.random.default_rng(1).integers(0, LLADA2["vocab"], size=40).tolist()
  _, logits = _our_logits(tmp_path / "out", tokens)
  if drop_bias:  # a checkpoint without expert_bias routes like the HF model with zero buffers
    with torch.no_grad():
      saved = [layer.mlp.gate.e_score_correction_bias.clone() for layer in glm4_moe.model.layers[1:]]
      for layer in glm4_moe.model.layers[1:]:
        layer.mlp.gate.e_score_correction_bias.zero_()
  try:
    reference = _reference_logits(glm4_moe, tokens, block_causal_reference_mask(40, 32))
  finally:
    if drop_bias:
      with torch.no_grad():
        for layer, bias in zip(glm4_moe.model.layers[1:], saved):
          layer.mlp.gate.e_score_correction_bias.copy_(bias)
  np.testing.assert_allclose(logits, reference, atol=TOLERANCE, rtol=0)
  bidirectional = _reference_logits(glm4_moe, tokens, np.zeros((40, 40), np.float32))
  assert np.abs(bidirectional - reference).max() > 1e-2  # the block-causal mask matters on these tokens


def test_llada2_missing_expert_and_misshapen_fused_projection_are_named(tmp_path, glm4_moe):
  tensors = llada2_checkpoint(tmp_path / "hf", glm4_moe)
  del tensors["model.layers.2.mlp.experts.7.down_proj.weight"]
  save_file(tensors, str(tmp_path / "hf" / "model.safetensors"))
  with pytest.raises(CheckpointError, match=r"missing tensors .*model\.layers\.2\.mlp\.experts\.7\.down_proj"):
    convert(str(tmp_path / "hf"), str(tmp_path / "out"))
  tensors = llada2_checkpoint(tmp_path / "hf", glm4_moe)
  qkv = "model.layers.1.attention.query_key_value.weight"
  tensors[qkv] = tensors[qkv][:-16]
  save_file(tensors, str(tmp_path / "hf" / "model.safetensors"))
  with pytest.raises(CheckpointError, match=rf"{qkv.replace('.', '[.]')} has shape \[112, 48\]; expected \[128, 48\]"):
    convert(str(tmp_path / "hf"), str(tmp_path / "out"))
  assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("overrides, message", [
    (dict(moe_layer_freq=[1, 0, 1]), r"moe_layer_freq.*only leading dense layers"),
    (dict(moe_layer_freq=[0, 1]), r"moe_layer_freq.*list of 3 entries"),
    (dict(partial_rotary_factor=-1), r"partial_rotary_factor.*placeholder -1"),
    (dict(shared_expert_intermediate_size=-1), r"shared_expert_intermediate_size.*placeholder -1"),
    (dict(attention_bias=True), r"attention_bias"),
    (dict(rope_scaling={"type": "linear", "factor": 2.0}), r"rope_scaling"),
])
def test_llada_moe_config_errors_name_the_field(tmp_path, qwen3_moe, overrides, message):
  llada_moe_checkpoint(tmp_path / "hf", qwen3_moe, **overrides)
  with pytest.raises(ConfigError, match=message):
    convert(str(tmp_path / "hf"), str(tmp_path / "out"))


def test_dense_llada_config_is_not_taken_for_llada_moe():
  assert detect_arch({"model_type": "llada", "d_model": 64}) == "llada"
  assert detect_arch({"model_type": "llada", "num_experts": 64}) == "llada-moe"
  assert detect_arch({"architectures": ["LLaDA2MoeModelLM"]}) == "llada2"
  assert detect_arch({"model_type": "llada21_moe"}) == "llada2"
