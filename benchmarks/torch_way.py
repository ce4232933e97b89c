"""LLaDA's low-confidence denoising done the way a PyTorch user does it today, for the benchmark.

`transformers` `LlamaForCausalLM` carries the weights (LLaDA blocks are Llama-shaped); the model runs
bidirectionally by receiving an explicit all-visible 4-D float mask; a Python loop over blocks and steps
follows the official `generate.py` (models.md §2.8): full-sequence logits every step, argmax, softmax
confidence, −inf beyond the block, per-row top-k transfer. Statistics come from eager attention with
`output_attentions=True` (column sums of every layer's [B, N, S, S] map). Top-1 sink masking needs a
different mask per layer and head, which `attention_mask` cannot express, so an attention function
registered with `transformers.AttentionInterface` adds the previous step's per-layer bias.
"""

from __future__ import annotations

import numpy as np
import torch
import transformers
from transformers import AttentionInterface
from transformers.models.llama import modeling_llama

_LAYER_BIAS: dict[str, torch.Tensor | None] = {"bias": None}


def _eager_with_layer_bias(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
  """Eager attention plus `_LAYER_BIAS["bias"][layer]` ([B, N, 1, S]) on the scores."""
  bias = _LAYER_BIAS["bias"]
  if bias is not None:
    layer_bias = bias[module.layer_idx]
    attention_mask = layer_bias if attention_mask is None else attention_mask + layer_bias
  return modeling_llama.eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout,
                                                **kwargs)


AttentionInterface.register("eager_layer_bias", _eager_with_layer_bias)


def _to_torch(array, dtype: torch.dtype, device: str) -> torch.Tensor:
  """A JAX/NumPy array as a torch tensor on `device` (zero-copy through DLPack for GPU-resident arrays)."""
  if device == "cuda" and hasattr(array, "__dlpack__"):
    return torch.from_dlpack(array).to(dtype)
  return torch.tensor(np.asarray(array, np.float32)).to(device=device, dtype=dtype)


def build_model(params: dict, config, attention: str, dtype: torch.dtype = torch.float32,
                device: str = "cpu") -> transformers.LlamaForCausalLM:
  """A LlamaForCausalLM holding our params (nested dict of arrays, see dlm_jax.model).

  The module is built on the meta device and the weights are assigned, so an 8B model is never
  randomly initialised first; the rotary tables (a non-persistent buffer) are then rebuilt on `device`.
  """
  hf_config = transformers.LlamaConfig(
      vocab_size=config.vocab_size, hidden_size=config.d_model, intermediate_size=config.mlp_hidden,
      num_hidden_layers=config.n_layers, num_attention_heads=config.n_heads,
      num_key_value_heads=config.n_kv_heads, head_dim=config.head_dim, rms_norm_eps=config.norm_eps,
      rope_theta=config.rope_theta, tie_word_embeddings=config.tied_embeddings, attn_implementation=attention,
      dtype=dtype)
  with torch.device("meta"):
    model = transformers.LlamaForCausalLM(hf_config)
  blocks = params["blocks"]
  convert = lambda array: _to_torch(array, dtype, device)  # noqa: E731
  state = {"model.embed_tokens.weight": convert(params["embed"]["embedding"]),
           "model.norm.weight": convert(params["final_norm"]["weight"]),
           "lm_head.weight": convert(params["lm_head"]["kernel"]).T.contiguous()}
  names = {"self_attn.q_proj": blocks["attn"]["q"], "self_attn.k_proj": blocks["attn"]["k"],
           "self_attn.v_proj": blocks["attn"]["v"], "self_attn.o_proj": blocks["attn"]["o"],
           "mlp.gate_proj": blocks["mlp"]["gate"], "mlp.up_proj": blocks["mlp"]["up"],
           "mlp.down_proj": blocks["mlp"]["down"]}
  for name, tree in names.items():
    stacked = convert(tree["kernel"])
    for layer in range(config.n_layers):
      state[f"model.layers.{layer}.{name}.weight"] = stacked[layer].T.contiguous()
  attn_norm, mlp_norm = convert(blocks["attn_norm"]["weight"]), convert(blocks["mlp_norm"]["weight"])
  for layer in range(config.n_layers):
    state[f"model.layers.{layer}.input_layernorm.weight"] = attn_norm[layer].clone()
    state[f"model.layers.{layer}.post_attention_layernorm.weight"] = mlp_norm[layer].clone()
  model.load_state_dict(state, strict=True, assign=True)
  model.model.rotary_emb = type(model.model.rotary_emb)(hf_config).to(device)
  return model.eval()


def transfer_counts(mask_count: torch.Tensor, steps: int) -> torch.Tensor:
  """[B] masked counts -> [B, steps] tokens to unmask per step (remainder on the first steps)."""
  base = mask_count[:, None] // steps
  remainder = mask_count % steps
  counts = base.repeat(1, steps)
  counts += (torch.arange(steps, device=mask_count.device)[None, :] < remainder[:, None]).long()
  return counts


@torch.no_grad()
def generate(model, prompt: torch.Tensor, *, gen_length: int, steps: int, block_length: int, mask_id: int,
             statistics: bool, mask_top_sinks: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
  """The official loop (temperature 0, low-confidence remasking). Returns tokens and per-step stats.

  statistics: keep incoming attention [L, B, N, S] per step (from `output_attentions`).
  mask_top_sinks: K > 0 masks, at each step, the K keys with the most incoming attention per (layer, head)
    at the previous step.
  """
  b, lp = prompt.shape
  device = prompt.device
  x = torch.cat([prompt, torch.full((b, gen_length), mask_id, dtype=torch.long, device=device)], dim=1)
  s = x.shape[1]
  visible = torch.zeros(b, 1, s, s, device=device, dtype=next(model.parameters()).dtype)
  num_blocks = gen_length // block_length
  steps_per_block = steps // num_blocks
  per_step_stats = []
  _LAYER_BIAS["bias"] = None
  for block in range(num_blocks):
    start, end = lp + block * block_length, lp + (block + 1) * block_length
    counts = transfer_counts((x[:, start:end] == mask_id).sum(dim=1), steps_per_block).tolist()
    for step in range(steps_per_block):
      mask_index = x == mask_id
      out = model(input_ids=x, attention_mask=visible, output_attentions=statistics or mask_top_sinks > 0)
      logits = out.logits
      if statistics or mask_top_sinks:
        incoming = torch.stack([a.sum(dim=2) for a in out.attentions])  # [L, B, N, S]
        if statistics:
          per_step_stats.append(incoming)
        if mask_top_sinks:
          sinks = incoming.topk(mask_top_sinks, dim=-1).indices
          bias = torch.zeros_like(incoming).scatter_(-1, sinks, torch.finfo(incoming.dtype).min)
          _LAYER_BIAS["bias"] = bias[:, :, :, None, :]
      x0 = logits.argmax(dim=-1)
      probs = torch.softmax(logits, dim=-1)
      confidence = torch.gather(probs, -1, x0[..., None])[..., 0]
      confidence[:, end:] = -np.inf
      x0 = torch.where(mask_index, x0, x)
      confidence = torch.where(mask_index, confidence, torch.tensor(-np.inf, device=device))
      transfer = torch.zeros_like(x0, dtype=torch.bool)
      for row in range(b):
        chosen = torch.topk(confidence[row], k=counts[row][step]).indices
        transfer[row, chosen] = True
      x[transfer] = x0[transfer]
  _LAYER_BIAS["bias"] = None
  return x, per_step_stats
