"""Hugging Face tensor names of each family -> our params-tree names (reference/models.md §2.4, §3.4, §5).

LLaDA / MMaDA (OLMo naming, `model.transformer.`):
  wte -> embed.embedding; blocks.N.{attn_norm, q_proj, k_proj, v_proj, attn_out, ff_norm,
  ff_proj (the SiLU gate), up_proj, ff_out (the MLP down projection)}; ln_f -> final_norm;
  transformer.ff_out (the LM head; same name as the blocks' down projection, one level up) -> lm_head.
Dream / Llama / Qwen2 (HF Llama naming): model.embed_tokens, model.layers.N.{input_layernorm,
  self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.{gate,up,down}_proj}, model.norm, lm_head.
  The dllm A2D Qwen2 models keep these names.
Qwen3, dllm A2D Qwen3 (Tiny-A2D, TIDE) and SDAR (small_dlms.md §2.2, §5.2): the HF Llama names plus
  self_attn.{q,k}_norm (per head [H]).
LLaDA-MoE (models_2026.md §2.2, §8.1): the HF Llama names plus self_attn.{q,k}_norm (per head [H]),
  mlp.gate (the router [E, D]), mlp.expert_bias [E] (with `router_expert_bias`),
  mlp.experts.E.{gate,up,down}_proj (one tensor per expert, stacked here into [E, ...]) and the layer's
  own shared_expert.{gate,up,down}_proj; dense layers keep mlp.{gate,up,down}_proj.
LLaDA2.x (models_2026.md §3.2, §8.2): model.word_embeddings; attention.query_key_value, one fused
  [(N + 2K)·H, D] projection whose rows are all query heads, then the key heads, then the value heads
  (split here into q, k, v); attention.{query,key}_layernorm; attention.dense (the output projection);
  mlp.gate.weight and mlp.gate.expert_bias (the selection bias; the HF model registers it in every MoE
  layer and treats a missing one as zeros, so do we); mlp.experts.E.*; mlp.shared_experts.*.

An MoE model's leading dense layers (`first_k_dense`) fill `dense_blocks.*` [k]; its layer i >= k fills
index i − k of `blocks.*`.

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
_QWEN3_LAYER = {
    **_HF_LAYER,
    "attn.q_norm.weight": ("self_attn.q_norm.weight", False),
    "attn.k_norm.weight": ("self_attn.k_norm.weight", False),
}
_HF_GLOBAL = {
    "embed.embedding": ("model.embed_tokens.weight", False),
    "final_norm.weight": ("model.norm.weight", False),
    "lm_head.kernel": ("lm_head.weight", True),
}

_MOE_COMMON = {
    "attn_norm.weight": ("input_layernorm.weight", False),
    "mlp_norm.weight": ("post_attention_layernorm.weight", False),
    "mlp.gate.kernel": ("mlp.gate_proj.weight", True),
    "mlp.up.kernel": ("mlp.up_proj.weight", True),
    "mlp.down.kernel": ("mlp.down_proj.weight", True),
    "mlp.router.kernel": ("mlp.gate.weight", True),
    "mlp.experts.gate.kernel": ("mlp.experts.{e}.gate_proj.weight", True),
    "mlp.experts.up.kernel": ("mlp.experts.{e}.up_proj.weight", True),
    "mlp.experts.down.kernel": ("mlp.experts.{e}.down_proj.weight", True),
}
_LLADA_MOE_LAYER = {
    **_MOE_COMMON,
    **{f"attn.{x}.kernel": (f"self_attn.{x}_proj.weight", True) for x in "qkvo"},
    **{f"attn.{x}.bias": (f"self_attn.{x}_proj.bias", False) for x in "qkv"},
    "attn.q_norm.weight": ("self_attn.q_norm.weight", False),
    "attn.k_norm.weight": ("self_attn.k_norm.weight", False),
    "mlp.router.score_bias": ("mlp.expert_bias", False),
    **{f"mlp.shared.{x}.kernel": (f"shared_expert.{x}_proj.weight", True) for x in ("gate", "up", "down")},
}
_LLADA2_LAYER = {
    **_MOE_COMMON,
    **{f"attn.{x}.kernel": ("attention.query_key_value.weight", True) for x in "qkv"},
    **{f"attn.{x}.bias": ("attention.query_key_value.bias", False) for x in "qkv"},
    "attn.o.kernel": ("attention.dense.weight", True),
    "attn.q_norm.weight": ("attention.query_layernorm.weight", False),
    "attn.k_norm.weight": ("attention.key_layernorm.weight", False),
    "mlp.router.score_bias": ("mlp.gate.expert_bias", False),
    **{f"mlp.shared.{x}.kernel": (f"mlp.shared_experts.{x}_proj.weight", True) for x in ("gate", "up", "down")},
}
_LLADA2_GLOBAL = {**_HF_GLOBAL, "embed.embedding": ("model.word_embeddings.weight", False)}
_OPTIONAL = {"llada2": ("mlp.router.score_bias",)}
"""Our per-layer names whose source may be absent (then zeros)."""
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
  return f"{IGNORED_SOURCES}|{re.escape(_tables(arch)[1]['lm_head.kernel'][0])}"


def _tables(arch: str) -> tuple[dict, dict, str]:
  if arch in ("llada", "mmada"):
    return _LLADA_LAYER, _LLADA_GLOBAL, "model.transformer.blocks.{}."
  if arch in ("dream", "llama", "qwen2", "a2d-qwen2"):
    return _HF_LAYER, _HF_GLOBAL, "model.layers.{}."
  if arch in ("qwen3", "a2d-qwen3", "sdar"):
    return _QWEN3_LAYER, _HF_GLOBAL, "model.layers.{}."
  if arch == "llada-moe":
    return _LLADA_MOE_LAYER, _HF_GLOBAL, "model.layers.{}."
  if arch == "llada2":
    return _LLADA2_LAYER, _LLADA2_GLOBAL, "model.layers.{}."
  raise ValueError(f"no tensor-name table for arch {arch!r}")


def _fused_rows(arch: str, name: str, expected: Mapping[str, tuple[int, ...]]) -> tuple[int, int] | None:
  """LLaDA2's fused query_key_value: the source rows of our q, k or v tensor `name` (None elsewhere)."""
  if arch != "llada2" or not name.startswith(("attn.q.", "attn.k.", "attn.v.")):
    return None
  q_width, kv_width = expected["blocks.attn.q.kernel"][-1], expected["blocks.attn.k.kernel"][-1]
  start = {"q": 0, "k": q_width, "v": q_width + kv_width}[name[len("attn.")]]
  return start, start + (q_width if name.startswith("attn.q.") else kv_width)


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
  first_moe_layer = expected["dense_blocks.attn_norm.weight"][0] if "dense_blocks.attn_norm.weight" in expected else 0
  fused_width = expected["blocks.attn.q.kernel"][-1] + 2 * expected["blocks.attn.k.kernel"][-1]
  pieces = []
  for target, shape in expected.items():
    stack, _, name = target.partition(".")
    if stack not in ("blocks", "dense_blocks"):
      source, transpose = global_table[target]
      pieces.append(Piece(target, source, tuple(reversed(shape)) if transpose else tuple(shape), None, transpose))
      continue
    offset = first_moe_layer if stack == "blocks" else 0
    source_suffix, transpose = layer_table[name]
    rows = _fused_rows(arch, name, expected)
    experts = "{e}" in source_suffix
    part = tuple(shape[2:] if experts else shape[1:])
    if rows is not None:  # the whole fused tensor: [(N + 2K)·H, D] (a bias: [(N + 2K)·H])
      source_shape = (fused_width,) + ((part[0],) if transpose else ())
    else:
      source_shape = tuple(reversed(part)) if transpose else part
    for layer in range(shape[0]):
      prefix = layer_prefix.format(layer + offset)
      if experts:
        pieces += [Piece(target, prefix + source_suffix.format(e=e), source_shape, layer, transpose, expert=e)
                   for e in range(shape[1])]
      else:
        pieces.append(Piece(target, prefix + source_suffix, source_shape, layer, transpose, rows=rows,
                            optional=name in _OPTIONAL.get(arch, ())))
  return pieces
