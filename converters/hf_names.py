"""Hugging Face tensor names of each family -> our params-tree names (reference/models.md §2.4, §3.4, §5).

LLaDA / MMaDA (OLMo naming, `model.transformer.`):
  wte -> embed.embedding; blocks.N.{attn_norm, q_proj, k_proj, v_proj, attn_out, ff_norm,
  ff_proj (the SiLU gate), up_proj, ff_out (the MLP down projection)}; ln_f -> final_norm;
  transformer.ff_out (the LM head; same name as the blocks' down projection, one level up) -> lm_head.
Dream / Llama / Qwen2 (HF Llama naming): model.embed_tokens, model.layers.N.{input_layernorm,
  self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.{gate,up,down}_proj}, model.norm, lm_head.

Torch Linear weights are [out, in]; our kernels are [in, out], so those pieces are transposed. The
embedding stays [V, D]; the head [V, D] becomes lm_head.kernel [D, V]. No q/k permutation is needed:
every family uses rotate-half RoPE in its own code, as we do.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from converters.plan import Piece

# our per-layer name (after "blocks.") -> (source name inside a layer, transposed)
_LLADA_LAYER = {
    "attn_norm.weight": ("attn_norm.weight", False),
    "attn.q.kernel": ("q_proj.weight", True), "attn.q.bias": ("q_proj.bias", False),
    "attn.k.kernel": ("k_proj.weight", True), "attn.k.bias": ("k_proj.bias", False),
    "attn.v.kernel": ("v_proj.weight", True), "attn.v.bias": ("v_proj.bias", False),
    "attn.o.kernel": ("attn_out.weight", True),
    "mlp_norm.weight": ("ff_norm.weight", False),
    "mlp.gate.kernel": ("ff_proj.weight", True),
    "mlp.up.kernel": ("up_proj.weight", True),
    "mlp.down.kernel": ("ff_out.weight", True),
}
_LLADA_GLOBAL = {
    "embed.embedding": ("model.transformer.wte.weight", False),
    "final_norm.weight": ("model.transformer.ln_f.weight", False),
    "lm_head.kernel": ("model.transformer.ff_out.weight", True),
}
_HF_LAYER = {
    "attn_norm.weight": ("input_layernorm.weight", False),
    "attn.q.kernel": ("self_attn.q_proj.weight", True), "attn.q.bias": ("self_attn.q_proj.bias", False),
    "attn.k.kernel": ("self_attn.k_proj.weight", True), "attn.k.bias": ("self_attn.k_proj.bias", False),
    "attn.v.kernel": ("self_attn.v_proj.weight", True), "attn.v.bias": ("self_attn.v_proj.bias", False),
    "attn.o.kernel": ("self_attn.o_proj.weight", True),
    "mlp_norm.weight": ("post_attention_layernorm.weight", False),
    "mlp.gate.kernel": ("mlp.gate_proj.weight", True),
    "mlp.up.kernel": ("mlp.up_proj.weight", True),
    "mlp.down.kernel": ("mlp.down_proj.weight", True),
}
_HF_GLOBAL = {
    "embed.embedding": ("model.embed_tokens.weight", False),
    "final_norm.weight": ("model.norm.weight", False),
    "lm_head.kernel": ("lm_head.weight", True),
}

IGNORED_SOURCES = r".*\.rotary_emb\.inv_freq"
"""Non-persistent RoPE buffers some older checkpoints still contain; they carry no weights."""


def ignored_sources(arch: str, tied: bool) -> str:
  """Regex of source names that may be present and are skipped: rotary buffers, and with tied embeddings
  a stored copy of the head (transformers ignores it too and reuses the embedding)."""
  if not tied:
    return IGNORED_SOURCES
  head = _LLADA_GLOBAL["lm_head.kernel"][0] if arch in ("llada", "mmada") else _HF_GLOBAL["lm_head.kernel"][0]
  return f"{IGNORED_SOURCES}|{re.escape(head)}"


def _tables(arch: str) -> tuple[dict, dict, str]:
  if arch in ("llada", "mmada"):
    return _LLADA_LAYER, _LLADA_GLOBAL, "model.transformer.blocks.{}."
  if arch in ("dream", "llama", "qwen2"):
    return _HF_LAYER, _HF_GLOBAL, "model.layers.{}."
  raise ValueError(f"no tensor-name table for arch {arch!r}")


def hf_plan(arch: str, expected: Mapping[str, tuple[int, ...]]) -> list[Piece]:
  """The pieces that fill every tensor of `expected` ({our name: shape}) from family `arch`'s names."""
  layer_table, global_table, layer_prefix = _tables(arch)
  pieces = []
  for target, shape in expected.items():
    if target.startswith("blocks."):
      source_suffix, transpose = layer_table[target[len("blocks."):]]
      per_layer = tuple(shape[1:])
      source_shape = tuple(reversed(per_layer)) if transpose else per_layer
      pieces += [Piece(target, layer_prefix.format(layer) + source_suffix, source_shape, layer, transpose)
                 for layer in range(shape[0])]
    else:
      source, transpose = global_table[target]
      pieces.append(Piece(target, source, tuple(reversed(shape)) if transpose else tuple(shape), None, transpose))
  return pieces
