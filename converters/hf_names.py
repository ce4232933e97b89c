"""Hugging Face tensor names of each family -> our params-tree names (reference/models.md §2.4, §3.4, §5).

LLaDA / MMaDA (OLMo naming, `model.transformer.`):
  wte -> embed.embedding; blocks.N.{attn_norm, q_proj, k_proj, v_proj, attn_out, ff_norm,
  ff_proj (the SiLU gate), up_proj, ff_out (the MLP down projection)}; ln_f -> final_norm;
  transformer.ff_out (the LM head; same name as the blocks' down projection, one level up) -> lm_head.
Dream / Llama / Qwen2 (HF Llama naming): model.embed_tokens, model.layers.N.{input_layernorm,
  self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.{gate,up,down}_proj}, model.norm, lm_head.

DiffusionGemma (transformers 5.23 save_pretrained, `model.decoder.`): embed_tokens, layers.N.{
  input_layernorm, self_attn.{q,k,v,o}_proj (no v_proj on full layers: K = V), self_attn.{q,k}_norm,
  post_attention_layernorm, pre_feedforward_layernorm, mlp.{gate,up,down}_proj, post_feedforward_layernorm_1,
  pre_feedforward_layernorm_2, router.{proj.weight, scale, per_expert_scale}, experts.gate_up_proj
  [E, 2F, D] (gate rows first), experts.down_proj [E, D, F], post_feedforward_layernorm_2,
  post_feedforward_layernorm, layer_scalar}, norm, self_conditioning.{pre_norm, gate_proj, up_proj,
  down_proj}. Sliding layers fill `blocks`, full layers `global_blocks`, each in layer order. The encoder's
  text weights are tied to these and not stored, except `model.encoder.language_model.layers.N.layer_scalar`
  (checked equal to the decoder's by the converter); lm_head is tied to embed_tokens; the vision tower
  (`model.encoder.vision_tower.*`, `model.encoder.embed_vision.*`) is out of scope and skipped.

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

_DG_LAYER = {
    "attn_norm.weight": ("input_layernorm.weight", False),
    "attn.q.kernel": ("self_attn.q_proj.weight", True),
    "attn.k.kernel": ("self_attn.k_proj.weight", True),
    "attn.v.kernel": ("self_attn.v_proj.weight", True),
    "attn.o.kernel": ("self_attn.o_proj.weight", True),
    "attn.q_norm.weight": ("self_attn.q_norm.weight", False),
    "attn.k_norm.weight": ("self_attn.k_norm.weight", False),
    "post_attn_norm.weight": ("post_attention_layernorm.weight", False),
    "mlp_norm.weight": ("pre_feedforward_layernorm.weight", False),
    "mlp.gate.kernel": ("mlp.gate_proj.weight", True),
    "mlp.up.kernel": ("mlp.up_proj.weight", True),
    "mlp.down.kernel": ("mlp.down_proj.weight", True),
    "post_mlp_norm.weight": ("post_feedforward_layernorm_1.weight", False),
    "moe_norm.weight": ("pre_feedforward_layernorm_2.weight", False),
    "moe.router.kernel": ("router.proj.weight", True),
    "moe.router.scale": ("router.scale", False),
    "moe.router.per_expert_scale": ("router.per_expert_scale", False),
    "post_moe_norm.weight": ("post_feedforward_layernorm_2.weight", False),
    "post_ffn_norm.weight": ("post_feedforward_layernorm.weight", False),
    "layer_scalar": ("layer_scalar", False),
}
_DG_GLOBAL = {
    "embed.embedding": ("model.decoder.embed_tokens.weight", False),
    "final_norm.weight": ("model.decoder.norm.weight", False),
    "self_conditioning.pre_norm.weight": ("model.decoder.self_conditioning.pre_norm.weight", False),
    "self_conditioning.mlp.gate.kernel": ("model.decoder.self_conditioning.gate_proj.weight", True),
    "self_conditioning.mlp.up.kernel": ("model.decoder.self_conditioning.up_proj.weight", True),
    "self_conditioning.mlp.down.kernel": ("model.decoder.self_conditioning.down_proj.weight", True),
}
DG_DECODER_LAYER = "model.decoder.layers.{}."
DG_ENCODER_LAYER_SCALAR = "model.encoder.language_model.layers.{}.layer_scalar"
DG_IGNORED = (r"model\.encoder\.vision_tower\..*|model\.encoder\.embed_vision\..*|"
              r"model\.encoder\.language_model\.layers\.\d+\.layer_scalar|lm_head\.weight")
"""DiffusionGemma sources that are not converted: the vision tower and its embedder (text only), the
encoder's layer_scalar copies (compared with the decoder's instead) and a stored tied head."""

IGNORED_SOURCES = r".*\.rotary_emb\.inv_freq"
"""Non-persistent RoPE buffers some older checkpoints still contain; they carry no weights."""


def ignored_sources(arch: str, tied: bool) -> str:
  """Regex of source names that may be present and are skipped: rotary buffers, and with tied embeddings
  a stored copy of the head (transformers ignores it too and reuses the embedding)."""
  if arch == "diffusion_gemma":
    return f"{IGNORED_SOURCES}|{DG_IGNORED}"
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


def diffusion_gemma_plan(layer_pattern: str, expected: Mapping[str, tuple[int, ...]]) -> list[Piece]:
  """The pieces of a DiffusionGemma checkpoint: `blocks` layer i <- the i-th sliding ("s") layer of
  `layer_pattern`, `global_blocks` layer j <- the j-th full ("g") layer; experts split and swapped."""
  layers = {"blocks": [i for i, k in enumerate(layer_pattern) if k == "s"],
            "global_blocks": [i for i, k in enumerate(layer_pattern) if k == "g"]}
  pieces = []
  for target, shape in expected.items():
    stack, _, name = target.partition(".")
    if stack not in layers:
      source, transpose = _DG_GLOBAL[target]
      pieces.append(Piece(target, source, tuple(reversed(shape)) if transpose else tuple(shape), None, transpose))
      continue
    per_layer = tuple(shape[1:])
    for index, layer in enumerate(layers[stack]):
      prefix = DG_DECODER_LAYER.format(layer)
      if name.startswith("moe.experts."):
        e, d_in, d_out = per_layer
        if name == "moe.experts.down.kernel":  # down_proj [E, D, F] -> [E, F, D]
          pieces.append(Piece(target, prefix + "experts.down_proj", (e, d_out, d_in), index, swap_last=True))
        else:  # gate_up_proj [E, 2F, D], gate rows first -> [E, D, F]
          rows = (0, d_out) if name == "moe.experts.gate.kernel" else (d_out, 2 * d_out)
          pieces.append(Piece(target, prefix + "experts.gate_up_proj", (e, 2 * d_out, d_in), index, split=rows,
                              swap_last=True))
        continue
      suffix, transpose = _DG_LAYER[name]
      pieces.append(Piece(target, prefix + suffix, tuple(reversed(per_layer)) if transpose else per_layer, index,
                          transpose))
  return pieces


def hf_plan(arch: str, expected: Mapping[str, tuple[int, ...]]) -> list[Piece]:
  """The pieces that fill every tensor of `expected` ({our name: shape}) from family `arch`'s names
  (not DiffusionGemma: see `diffusion_gemma_plan`)."""
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
