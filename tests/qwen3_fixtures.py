"""Tiny random Qwen3 checkpoints in the hub layout of each Qwen3-based variant (reference/small_dlms.md),
written with transformers' `save_pretrained` and then given the variant's config fields and tokenizer files:

  qwen3  stock Qwen3ForCausalLM
  mdlm   dllm Tiny-A2D MDLM: model_type a2d-qwen3, A2DQwen3LMHeadModel, auto_map, mask in added_tokens.json,
         the tied head stored anyway (as the hub's Qwen3-0.6B files do)
  bd3lm  the same files in a directory named like `Qwen3-0.6B-diffusion-bd3lm-v0.1`
  tide   a TIDE student: bd3lm's layout, HF cache snapshot of `TIDE-dllm/distill-LLaDA2-TIDE_Cross`, the mask
         in tokenizer_config.json's added_tokens_decoder
  sdar   SDARForCausalLM, model_type sdar, block_size and mask_token_id in config.json, untied, SDAR's
         training switches (attn_implementation flex_attention, fuse_cross_entropy, ...)

The mdlm, bd3lm and sdar files carry the transformers-4.5x spelling of RoPE (`rope_theta`, `rope_scaling`
null, `torch_dtype`) that those repositories were saved with; qwen3 and tide keep 5.x's `rope_parameters`.
The reference runs eager attention with an explicit 4-D float mask (`hf_mask`).
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch
import transformers
from safetensors.torch import load_file, save_file

try:
  from tests import hf_fixtures
except ImportError:
  import hf_fixtures

VOCAB, MASK_ID = 96, 95
DIMS = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=256, bos_token_id=0,
            eos_token_id=1, pad_token_id=1)
"""head_dim 16 with hidden 48 and 4 heads: the q width 64 differs from hidden, as in Qwen3-0.6B (2048 / 1024)."""

VARIANTS = {
    # variant: (directory relative to the fixture root, tied, expected block size after conversion)
    "qwen3": ("Qwen3-tiny", True, None),
    "mdlm": ("Qwen3-tiny-diffusion-mdlm-v0.1", True, None),
    "bd3lm": ("Qwen3-tiny-diffusion-bd3lm-v0.1", True, 32),
    "tide": ("hub/models--TIDE-dllm--distill-LLaDA2-TIDE_Cross/snapshots/0123abc", True, 32),
    "sdar": ("SDAR-tiny-Chat", False, 4),
}
_A2D_AUTO_MAP = {"AutoConfig": "modeling_qwen3.A2DQwen3Config", "AutoModel": "modeling_qwen3.A2DQwen3Model",
                 "AutoModelForMaskedLM": "modeling_qwen3.A2DQwen3LMHeadModel"}
_SDAR_AUTO_MAP = {"AutoConfig": "configuration_sdar.SDARConfig", "AutoModel": "modeling_sdar.SDARModel",
                  "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM"}


def reference_model(tied: bool, seed: int) -> torch.nn.Module:
  """A random float32 Qwen3ForCausalLM (eager attention) whose every parameter matters; the mask token's
  embedding (and head row) is scaled down so that the model rarely predicts the mask token itself (a random
  tied model would otherwise predict it at every masked position and samplers would never unmask)."""
  config = transformers.Qwen3Config(**DIMS, rope_theta=1_000_000.0, tie_word_embeddings=tied,
                                    attn_implementation="eager", dtype=torch.float32)
  model = transformers.Qwen3ForCausalLM(config)
  hf_fixtures.randomize_parameters(model, seed)
  with torch.no_grad():
    model.model.embed_tokens.weight[MASK_ID] *= 0.05
    if not tied:
      model.lm_head.weight[MASK_ID] *= 0.05
  return model.eval()


def _edit_json(path: str, drop: tuple[str, ...] = (), **changes) -> None:
  with open(path, encoding="utf-8") as f:
    values = json.load(f)
  for key in drop:
    values.pop(key, None)
  values.update(changes)
  with open(path, "w", encoding="utf-8") as f:
    json.dump(values, f, indent=2)


def build(variant: str, root: str, seed: int = 0) -> tuple[str, torch.nn.Module]:
  """Writes the variant's checkpoint under `root`; returns (its directory, the reference model)."""
  relative, tied, _ = VARIANTS[variant]
  directory = os.path.join(root, relative)
  model = reference_model(tied, seed)
  model.save_pretrained(directory)
  config = os.path.join(directory, "config.json")
  if variant in ("mdlm", "bd3lm", "sdar"):
    _edit_json(config, drop=("rope_parameters", "dtype"), rope_theta=1_000_000.0, rope_scaling=None,
               torch_dtype="float32")
  if variant in ("mdlm", "bd3lm", "tide"):
    _edit_json(config, model_type="a2d-qwen3", architectures=["A2DQwen3LMHeadModel"], auto_map=_A2D_AUTO_MAP)
    weights = os.path.join(directory, "model.safetensors")
    tensors = load_file(weights)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, weights, metadata={"format": "pt"})
  if variant == "sdar":
    _edit_json(config, model_type="sdar", architectures=["SDARForCausalLM"], auto_map=_SDAR_AUTO_MAP,
               block_size=4, mask_token_id=MASK_ID, attn_implementation="flex_attention", fuse_cross_entropy=True,
               ep_size=1, use_deepep=False, micro_forward=False, skip_checkpoint=False, debug=False, use_cache=False)
  if variant in ("mdlm", "bd3lm"):
    with open(os.path.join(directory, "added_tokens.json"), "w", encoding="utf-8") as f:
      json.dump({"<think>": MASK_ID - 2, "</think>": MASK_ID - 1, "<|mask|>": MASK_ID}, f)
  if variant == "tide":
    decoder = {str(MASK_ID - 1): {"content": "</think>", "special": False},
               str(MASK_ID): {"content": "<|mask|>", "special": True}}
    with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
      json.dump({"added_tokens_decoder": decoder, "mask_token": "<|mask|>"}, f)
  return directory, model


def hf_mask(length: int, attention: str, block: int | None = None) -> np.ndarray:
  """[1, 1, T, T] additive float mask: "bidirectional" zeros, "causal" −inf above the diagonal,
  "block" −inf where key j's block j // block is after query i's."""
  index = np.arange(length)
  if attention == "bidirectional":
    hidden = np.zeros((length, length), bool)
  elif attention == "causal":
    hidden = index[None, :] > index[:, None]
  else:
    hidden = index[None, :] // block > index[:, None] // block
  return np.where(hidden, -np.inf, 0.0).astype(np.float32)[None, None]


def reference_logits(model: torch.nn.Module, tokens: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
  """[B, T, V] float32 logits; mask None = the model's own (causal) attention."""
  attention = None if mask is None else torch.as_tensor(np.repeat(mask, len(tokens), axis=0))
  with torch.no_grad():
    return model(input_ids=torch.as_tensor(tokens), attention_mask=attention).logits.float().numpy()
