"""Hugging Face-format checkpoints in each family's own naming and config format, from tiny random models.

LLaDA and MMaDA: a transformers Llama (or, with q/k/v biases, Qwen2) model whose tensors are renamed to
the OLMo-style names (model.transformer.blocks.N.q_proj, ff_proj, ff_out, ...) next to an LLaDA/MMaDA
config.json. Dream: a Qwen2 model with a Dream config.json. Llama and Qwen2: the models as transformers
saves them. The reference model is returned so its logits can be compared (bidirectional for the DLM
families: an explicit all-visible 4-D float mask with eager attention).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re

import numpy as np
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

FAMILIES = ("llada", "mmada", "dream", "llama", "qwen2")
DIFFUSION = ("llada", "mmada", "dream")

_OLMO_LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "q_proj.weight",
    "self_attn.k_proj.weight": "k_proj.weight", "self_attn.v_proj.weight": "v_proj.weight",
    "self_attn.q_proj.bias": "q_proj.bias", "self_attn.k_proj.bias": "k_proj.bias",
    "self_attn.v_proj.bias": "v_proj.bias", "self_attn.o_proj.weight": "attn_out.weight",
    "post_attention_layernorm.weight": "ff_norm.weight", "mlp.gate_proj.weight": "ff_proj.weight",
    "mlp.up_proj.weight": "up_proj.weight", "mlp.down_proj.weight": "ff_out.weight"}
_OLMO_GLOBAL = {"model.embed_tokens.weight": "model.transformer.wte.weight",
                "model.norm.weight": "model.transformer.ln_f.weight",
                "lm_head.weight": "model.transformer.ff_out.weight"}


@dataclasses.dataclass(frozen=True)
class Spec:
  """A tiny model of one family. qkv_bias only changes LLaDA/MMaDA (Dream and Qwen2 always have it)."""

  family: str
  hidden: int = 48
  layers: int = 2
  heads: int = 4
  kv_heads: int = 2
  intermediate: int = 80
  vocab: int = 96
  tied: bool = False
  qkv_bias: bool = False
  shards: int = 1
  storage: str = "float32"  # or "bfloat16"
  rope_theta: float = 10000.0
  norm_eps: float = 1e-5
  seed: int = 0

  @property
  def bidirectional(self) -> bool:
    return self.family in DIFFUSION

  @property
  def uses_qwen2(self) -> bool:
    return self.family in ("dream", "qwen2") or self.qkv_bias


def reference_model(spec: Spec) -> torch.nn.Module:
  """The random transformers model behind a fixture (float32, eval mode, eager attention)."""
  common = dict(hidden_size=spec.hidden, num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
                num_key_value_heads=spec.kv_heads, intermediate_size=spec.intermediate, vocab_size=spec.vocab,
                rms_norm_eps=spec.norm_eps, rope_theta=spec.rope_theta, tie_word_embeddings=spec.tied,
                bos_token_id=0, eos_token_id=1, pad_token_id=1, attn_implementation="eager")
  if spec.uses_qwen2:
    model = Qwen2ForCausalLM(Qwen2Config(**common))
  else:
    model = LlamaForCausalLM(LlamaConfig(**common))
  randomize_parameters(model, spec.seed, spec.storage)
  return model.eval()


def randomize_parameters(model: torch.nn.Module, seed: int, storage: str = "float32") -> None:
  """Random values for every parameter so that each one matters: norm weights 1 + 0.3·N(0, 1), biases
  0.3·N(0, 1), embeddings N(0, 1), other weights (2-D Linear or 3-D stacked experts) N(0, 1)/√(last dim);
  rounded through bfloat16 when `storage` is "bfloat16"."""
  generator = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=generator)
      if name.endswith("norm.weight"):
        p.copy_(1.0 + 0.3 * noise)
      elif name.endswith("bias"):
        p.copy_(0.3 * noise)
      elif "embed_tokens" in name:
        p.copy_(noise)
      else:
        p.copy_(noise / np.sqrt(p.shape[-1]))
      if storage == "bfloat16":
        p.copy_(p.to(torch.bfloat16).to(torch.float32))


def _olmo_name(name: str) -> str:
  match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
  if match:
    return f"model.transformer.blocks.{match[1]}.{_OLMO_LAYER[match[2]]}"
  return _OLMO_GLOBAL[name]


def _family_config(spec: Spec, model: torch.nn.Module) -> dict:
  ids = dict(eos_token_id=1, pad_token_id=1, mask_token_id=spec.vocab - 1)
  if spec.family in ("llada", "mmada"):
    config = dict(
        architectures=["LLaDAModelLM"], model_type="llada", d_model=spec.hidden, n_layers=spec.layers,
        n_heads=spec.heads, n_kv_heads=spec.kv_heads, mlp_hidden_size=spec.intermediate, mlp_ratio=4,
        activation_type="silu", block_type="llama", block_group_size=1, vocab_size=spec.vocab,
        embedding_size=spec.vocab, weight_tying=spec.tied, include_bias=False, include_qkv_bias=spec.qkv_bias,
        bias_for_layer_norm=False, layer_norm_type="rms", layer_norm_with_affine=True, rms_norm_eps=spec.norm_eps,
        attention_layer_norm=False, rope=True, rope_theta=spec.rope_theta, rope_full_precision=True, alibi=False,
        alibi_bias_max=8.0, max_sequence_length=4096, flash_attention=False, input_emb_norm=False,
        scale_logits=False, multi_query_attention=None, attention_dropout=0.0, residual_dropout=0.0,
        embedding_dropout=0.0, init_fn="mitchell", init_std=0.02, init_device="meta", precision="amp_bf16",
        use_cache=False, **ids)
    if spec.family == "mmada":
      config.update(architectures=["MMadaModelLM"], model_type="mmada", llm_vocab_size=spec.vocab - 8,
                    codebook_size=8, num_vq_tokens=4, num_new_special_tokens=0, new_vocab_size=spec.vocab)
    return config
  if spec.family == "dream":
    return dict(
        architectures=["DreamModel"], model_type="Dream", hidden_size=spec.hidden, num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads, intermediate_size=spec.intermediate,
        hidden_act="silu", vocab_size=spec.vocab, rms_norm_eps=spec.norm_eps, rope_theta=spec.rope_theta,
        rope_scaling=None, tie_word_embeddings=spec.tied, max_position_embeddings=2048, sliding_window=None,
        use_sliding_window=False, max_window_layers=spec.layers, attention_dropout=0.0, torch_dtype="bfloat16",
        bos_token_id=0, **ids)
  config = json.loads(model.config.to_json_string())  # what save_pretrained writes (transformers 5 style)
  config["architectures"] = [type(model).__name__]
  return config


def hf_tensors(spec: Spec, model: torch.nn.Module) -> dict[str, torch.Tensor]:
  """The model's tensors under the family's own names, in the storage dtype."""
  tensors = {}
  for name, value in model.state_dict().items():
    if spec.tied and name == "lm_head.weight":
      continue
    if spec.family in ("llada", "mmada"):
      name = _olmo_name(name)
    tensors[name] = value.detach().to(getattr(torch, spec.storage)).contiguous().clone()
  return tensors


def write_checkpoint(directory: str, config: dict, tensors: dict[str, torch.Tensor], shards: int = 1) -> None:
  """config.json, safetensors file(s) (an index when shards > 1) and two placeholder tokenizer files."""
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(config, f, indent=2)
  names = sorted(tensors)
  if shards == 1:
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
  else:
    weight_map = {}
    for k in range(shards):
      file_name = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
      part = {n: tensors[n] for n in names[k::shards]}
      save_file(part, os.path.join(directory, file_name), metadata={"format": "pt"})
      weight_map.update({n: file_name for n in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
      json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
  with open(os.path.join(directory, "tokenizer.json"), "w") as f:
    json.dump({"fixture": str(config.get("model_type"))}, f)
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump({"model_max_length": 128}, f)


def build(spec: Spec, directory: str) -> torch.nn.Module:
  """Writes the fixture checkpoint of `spec` into `directory`; returns its reference model."""
  model = reference_model(spec)
  write_checkpoint(directory, _family_config(spec, model), hf_tensors(spec, model), spec.shards)
  return model


def reference_outputs(model: torch.nn.Module, token_ids, bidirectional: bool) -> tuple[np.ndarray, np.ndarray]:
  """HF logits [S, V] and incoming attention [L, N, S] (attention probabilities summed over queries)."""
  ids = torch.tensor([list(token_ids)])
  n = ids.shape[1]
  mask = torch.zeros(1, 1, n, n) if bidirectional else None
  with torch.no_grad():
    out = model(input_ids=ids, attention_mask=mask, output_attentions=True)
  incoming = torch.stack([a[0].sum(dim=1) for a in out.attentions])
  return out.logits[0].float().numpy(), incoming.float().numpy()
