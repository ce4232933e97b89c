"""Each family's own config.json -> our `ModelConfig` (reference/models.md §2.2, §3.2, §4.2, §5;
models_2026.md §2, §3, §8 for LLaDA-MoE and LLaDA2.x).

LLaDA and MMaDA use OLMo-style fields (`d_model`, `n_layers`, `mlp_hidden_size`, `weight_tying`, ...);
Dream, Llama and Qwen2 use Hugging Face fields (`hidden_size`, `num_hidden_layers`, ...); DiffusionGemma
keeps them in `text_config` (with `layer_types`, `per_layer_config`, per-type `rope_parameters`). Switches our
model does not implement (OLMo's fused `sequential` block, biases outside q/k/v, RoPE scaling, sliding
windows, ...) are refused with an error that names the field, rather than converted silently.
"""

from __future__ import annotations

from typing import Any

from absl import logging

from converters import hf_qwen3
from dlm_jax.config import ConfigError, ModelConfig

ARCHS = ("llada", "mmada", "dream", "llama", "qwen2", "llada-moe", "llada2", "diffusion_gemma") + hf_qwen3.ARCHS

_MODEL_TYPES = {"llada": "llada", "mmada": "mmada", "dream": "dream", "llama": "llama", "qwen2": "qwen2",
                "lladamoe": "llada-moe", "llada_moe": "llada-moe", "llada2_moe": "llada2", "llada21_moe": "llada2",
                "diffusion_gemma": "diffusion_gemma", **hf_qwen3.MODEL_TYPES}
_ARCHITECTURES = {"LLaDAModelLM": "llada", "MMadaModelLM": "mmada", "DreamModel": "dream",
                  "LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "LLaDAMoEModelLM": "llada-moe",
                  "LLaDA2MoeModelLM": "llada2", "DiffusionGemmaForBlockDiffusion": "diffusion_gemma",
                  **hf_qwen3.ARCHITECTURES}
_LLADA_MOE_KEYS = ("num_experts", "expert_intermediate_size")
"""LLaDA-MoE's hub config says model_type "llada" like the dense LLaDA; these keys tell it apart."""

# Special-token defaults from models.md, used only when config.json omits the field and the id fits the
# vocabulary (LLaDA keeps BOS in generation_config.json; EoT ids are chat-template facts).
_LLADA_DEFAULTS = dict(mask_token_id=126336, eos_token_id=126081, pad_token_id=126081, bos_token_id=126080,
                       eot_token_id=126348)
_DREAM_MASK, _QWEN_EOT = 151666, 151645


def detect_arch(hf: dict[str, Any]) -> str:
  """The family of an HF config.json, from `model_type`, else `architectures`. A "llada" config with
  LLaDA-MoE's expert fields or architecture is LLaDA-MoE."""
  model_type = str(hf.get("model_type", "")).lower()
  architectures = [a for a in hf.get("architectures") or () if isinstance(a, str)] if isinstance(
      hf.get("architectures"), list) else []
  if model_type == "llada" and (any(key in hf for key in _LLADA_MOE_KEYS) or "LLaDAMoEModelLM" in architectures):
    return "llada-moe"
  if model_type in _MODEL_TYPES:
    return _MODEL_TYPES[model_type]
  for name in architectures:
    if name in _ARCHITECTURES:
      return _ARCHITECTURES[name]
  raise ConfigError(f"config.json: cannot tell the architecture from model_type={hf.get('model_type')!r} and "
                    f"architectures={hf.get('architectures')!r}; expected model_type in {sorted(_MODEL_TYPES)} or "
                    f"architectures in {sorted(_ARCHITECTURES)}. Pass --arch explicitly (one of {', '.join(ARCHS)}).")


class _Fields:
  """Typed access to config.json with errors that name the field."""

  def __init__(self, hf: dict[str, Any], family: str):
    self.hf, self.family = hf, family

  def has(self, key: str) -> bool:
    return self.hf.get(key) is not None

  def required(self, key: str, meaning: str) -> Any:
    if key not in self.hf or self.hf[key] is None:
      raise ConfigError(f"config.json ({self.family}): missing required field {key!r} ({meaning}).")
    return self.hf[key]

  def integer(self, key: str, meaning: str, default: Any = None) -> int:
    value = self.required(key, meaning) if default is None or self.has(key) else default
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
      raise ConfigError(f"config.json ({self.family}): field {key!r} ({meaning}) must be a positive integer, "
                        f"got {value!r}.")
    return value

  def number(self, key: str, meaning: str) -> float:
    value = self.required(key, meaning)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise ConfigError(f"config.json ({self.family}): field {key!r} ({meaning}) must be a number, got {value!r}.")
    return float(value)

  def flag(self, key: str, default: bool) -> bool:
    value = self.hf.get(key, default)
    value = default if value is None else value
    if not isinstance(value, bool):
      raise ConfigError(f"config.json ({self.family}): field {key!r} must be true or false, got {value!r}.")
    return value

  def refuse(self, key: str, allowed: tuple[Any, ...], why: str) -> None:
    """Errors when `key` is present with a value outside `allowed` (None counts as absent)."""
    if key in self.hf and self.hf[key] is not None and self.hf[key] not in allowed:
      expected = " or ".join(repr(a) for a in allowed) if allowed else "null/absent"
      raise ConfigError(f"config.json ({self.family}): field {key!r} is {self.hf[key]!r}; expected {expected}. "
                        f"{why}")

  def token(self, key: str, vocab_size: int, default: int | None = None) -> int | None:
    """A special-token id; a list (several EOS ids) gives its first entry.

    Defaults apply only when the field is absent and the id fits the vocabulary. An id outside
    [0, vocab_size) (e.g. the real LLaDA ids left in a shrunken test config) becomes None with a warning:
    such a token can never occur, and the weights convert the same.
    """
    value = self.hf.get(key)
    if isinstance(value, list):
      value = value[0] if value else None
    if value is None:
      return default if default is not None and default < vocab_size else None
    if isinstance(value, bool) or not isinstance(value, int):
      raise ConfigError(f"config.json ({self.family}): field {key!r} is {value!r}; expected a token id.")
    if not 0 <= value < vocab_size:
      logging.warning("config.json (%s): %s=%d is outside the vocabulary [0, %d); it is dropped.", self.family,
                      key, value, vocab_size)
      return None
    return value


def _check_no_rope_scaling(f: _Fields) -> None:
  why = "RoPE scaling (e.g. Llama-3.1 'llama3', YaRN, linear) is not supported; only plain RoPE is."
  f.refuse("rope_scaling", (), why)
  params = f.hf.get("rope_parameters")
  if isinstance(params, dict) and params.get("rope_type", "default") not in ("default", None):
    raise ConfigError(f"config.json ({f.family}): field 'rope_parameters.rope_type' is "
                      f"{params.get('rope_type')!r}; expected 'default'. {why}")


def _rope_theta(f: _Fields) -> float:
  """`rope_theta` at top level (transformers 4) or inside `rope_parameters` (transformers 5)."""
  params = f.hf.get("rope_parameters")
  if not f.has("rope_theta") and isinstance(params, dict) and params.get("rope_theta") is not None:
    return float(params["rope_theta"])
  return f.number("rope_theta", "RoPE base θ")


def llada_fields(hf: dict[str, Any], family: str = "llada") -> dict[str, Any]:
  """LLaDA / MMaDA (OLMo-style) config.json -> ModelConfig fields: bidirectional, no shift, fp32 RoPE."""
  f = _Fields(hf, family)
  f.required("block_type", "OLMo block type; must be 'llama'")
  f.refuse("block_type", ("llama",), "Only LLaDA's 'llama' block (separate q_proj/k_proj/v_proj, ff_proj/up_proj) "
           "is supported; fused 'sequential' OLMo blocks are not.")
  f.refuse("block_group_size", (1,), "Grouped blocks (transformer.block_groups.*) are not supported.")
  f.refuse("activation_type", ("silu",), "The LLaDA llama block applies SiLU to ff_proj and multiplies by up_proj.")
  f.refuse("layer_norm_type", ("rms",), "Only RMSNorm is supported.")
  f.refuse("layer_norm_with_affine", (True,), "RMSNorm must have a weight.")
  for key, why in (("include_bias", "Biases outside q/k/v are not supported."),
                   ("bias_for_layer_norm", "Norm biases are not supported."),
                   ("attention_layer_norm", "QK-norm is not supported."), ("alibi", "ALiBi is not supported."),
                   ("input_emb_norm", "Embedding scaling is not supported."),
                   ("scale_logits", "Logit scaling is not supported.")):
    f.refuse(key, (False,), why)
  f.refuse("rope", (True,), "Only RoPE positions are supported.")
  f.refuse("rope_scaling", (), "RoPE scaling is not supported.")
  n_heads = f.integer("n_heads", "query heads")
  kv_default = 1 if f.flag("multi_query_attention", False) else n_heads
  n_kv_heads = f.integer("n_kv_heads", "key/value heads", default=kv_default)
  d_model = f.integer("d_model", "hidden size")
  if d_model % n_heads:
    raise ConfigError(f"config.json ({family}): d_model={d_model} is not a multiple of n_heads={n_heads}.")
  f.integer("vocab_size", "tokenizer vocabulary")
  vocab = f.integer("embedding_size", "embedding rows", default=hf["vocab_size"])
  tokens = {key: f.token(key, vocab, default) for key, default in _LLADA_DEFAULTS.items()}
  f.required("weight_tying", "whether wte doubles as the LM head")
  return dict(
      d_model=d_model, n_layers=f.integer("n_layers", "number of blocks"), n_heads=n_heads,
      n_kv_heads=n_kv_heads, head_dim=d_model // n_heads,
      mlp_hidden=f.integer("mlp_hidden_size", "SwiGLU hidden width"), vocab_size=vocab,
      norm_eps=f.number("rms_norm_eps", "RMSNorm epsilon"), rope_theta=f.number("rope_theta", "RoPE base θ"),
      rope_fp32=f.flag("rope_full_precision", True), qkv_bias=f.flag("include_qkv_bias", False),
      tied_embeddings=f.flag("weight_tying", False),
      causal=False, logit_shift=0, **tokens)


def hf_llama_like_fields(hf: dict[str, Any], family: str) -> dict[str, Any]:
  """Dream / Llama / Qwen2 (Hugging Face fields) config.json -> ModelConfig fields."""
  f = _Fields(hf, family)
  _check_no_rope_scaling(f)
  f.refuse("hidden_act", ("silu",), "The MLP must be SwiGLU with SiLU.")
  f.refuse("attention_bias", (False,), "Biases on o_proj are not supported (Llama attention_bias).")
  f.refuse("mlp_bias", (False,), "MLP biases are not supported.")
  f.refuse("use_sliding_window", (False,), "Sliding-window attention is not supported.")
  layer_types = hf.get("layer_types") or ()
  if any(t != "full_attention" for t in layer_types):
    raise ConfigError(f"config.json ({family}): field 'layer_types' contains {sorted(set(layer_types))}; expected "
                      "only 'full_attention' (sliding-window layers are not supported).")
  hidden = f.integer("hidden_size", "hidden size")
  n_heads = f.integer("num_attention_heads", "query heads")
  if not f.has("head_dim") and hidden % n_heads:
    raise ConfigError(f"config.json ({family}): hidden_size={hidden} is not a multiple of "
                      f"num_attention_heads={n_heads}; add head_dim.")
  vocab = f.integer("vocab_size", "embedding rows")
  diffusion = family == "dream"
  mask = f.token("mask_token_id", vocab, _DREAM_MASK) if diffusion else None
  if family in ("dream", "qwen2") + hf_qwen3.ARCHS:
    eot = f.token("eot_token_id", vocab, _QWEN_EOT)  # <|im_end|>
  else:  # Llama-3 Instruct lists several EOS ids, the last being <|eot_id|>.
    eos = hf.get("eos_token_id")
    last = eos[-1] if isinstance(eos, list) and len(eos) > 1 else None
    eot = last if isinstance(last, int) and not isinstance(last, bool) and 0 <= last < vocab else None
  return dict(
      d_model=hidden, n_layers=f.integer("num_hidden_layers", "number of layers"), n_heads=n_heads,
      n_kv_heads=f.integer("num_key_value_heads", "key/value heads", default=n_heads),
      head_dim=f.integer("head_dim", "per-head width", default=hidden // n_heads),
      mlp_hidden=f.integer("intermediate_size", "SwiGLU hidden width"), vocab_size=vocab,
      norm_eps=f.number("rms_norm_eps", "RMSNorm epsilon"), rope_theta=_rope_theta(f), rope_fp32=False,
      qkv_bias=family in ("dream", "qwen2"), tied_embeddings=f.flag("tie_word_embeddings", False),
      causal=not diffusion, logit_shift=1, mask_token_id=mask, eos_token_id=f.token("eos_token_id", vocab),
      eot_token_id=eot, bos_token_id=f.token("bos_token_id", vocab), pad_token_id=f.token("pad_token_id", vocab))


_LING_TOKENS = dict(mask_token_id=156895, eos_token_id=156892, pad_token_id=156892)
"""The Ling tokenizer's ids (models_2026.md §1): the defaults when config.json has none that fits."""


def _moe_common(f: _Fields) -> dict[str, Any]:
  """Fields LLaDA-MoE and LLaDA2 spell alike: attention shapes, RoPE (full or partial), eps, tokens."""
  _check_no_rope_scaling(f)
  f.refuse("hidden_act", ("silu",), "The experts and dense layers must be SwiGLU with SiLU.")
  hidden = f.integer("hidden_size", "hidden size")
  n_heads = f.integer("num_attention_heads", "query heads")
  kv = f.hf.get("num_key_value_heads")
  if kv == 0:  # the LLaDA2.0 class default; the 2.1 class (and transformers) read it as MHA
    kv = None
  if not f.has("head_dim") and hidden % n_heads:
    raise ConfigError(f"config.json ({f.family}): hidden_size={hidden} is not a multiple of "
                      f"num_attention_heads={n_heads}; add head_dim.")
  head_dim = f.integer("head_dim", "per-head width", default=hidden // n_heads)
  factor = f.hf.get("partial_rotary_factor", 1.0)
  factor = 1.0 if factor is None else factor
  if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
    raise ConfigError(f"config.json ({f.family}): field 'partial_rotary_factor' is {factor!r}; expected a "
                      "number in (0, 1] (the fraction of each head RoPE rotates; the class placeholder -1 must "
                      "be replaced by the checkpoint's value).")
  rotary = int(head_dim * factor)
  vocab = f.integer("vocab_size", "embedding rows")
  tokens = {key: f.token(key, vocab, default) for key, default in _LING_TOKENS.items()}
  return dict(
      d_model=hidden, n_layers=f.integer("num_hidden_layers", "number of layers"), n_heads=n_heads,
      n_kv_heads=f.integer("num_key_value_heads", "key/value heads", default=n_heads) if kv else n_heads,
      head_dim=head_dim, vocab_size=vocab, norm_eps=f.number("rms_norm_eps", "RMSNorm epsilon"),
      rope_theta=_rope_theta(f), rope_fp32=False, rotary_dim=None if rotary == head_dim else rotary,
      tied_embeddings=f.flag("tie_word_embeddings", False), causal=False, logit_shift=0,
      eos_token_id=f.token("eos_token_id", vocab, _LING_TOKENS["eos_token_id"]),
      **{k: v for k, v in tokens.items() if k != "eos_token_id"})


def _unused_width(value: Any, fallback: Any) -> int:
  """`mlp_hidden` of an MoE model without dense layers (unused): the config's dense width when it is a
  real one (not the class placeholder -1), else the expert width."""
  if isinstance(value, int) and not isinstance(value, bool) and value > 0:
    return value
  return fallback if isinstance(fallback, int) and not isinstance(fallback, bool) and fallback > 0 else 1


def llada_moe_fields(hf: dict[str, Any]) -> dict[str, Any]:
  """LLaDA-MoE config.json (`LLaDAConfig` with expert fields, models_2026.md §2.1, §8.1) -> ModelConfig
  fields: bidirectional, per-head QK norm, softmax top-k router without renormalisation (the HF code
  hard-codes it and never reads norm_topk_prob, the score function, scaling or groups; neither do we)."""
  f = _Fields(hf, "llada-moe")
  f.refuse("attention_bias", (False,), "Biases on the attention projections are not supported.")
  f.refuse("clip_qkv", (), "Clipping q/k/v is not supported.")
  layers = f.integer("num_hidden_layers", "number of layers")
  freq = hf.get("moe_layer_freq")
  if freq is None or freq == 1:
    first_dense = 0
  elif isinstance(freq, list) and len(freq) == layers and all(v in (0, 1) for v in freq):
    first_dense = freq.index(1) if 1 in freq else layers
    if any(v == 0 for v in freq[first_dense:]):
      raise ConfigError(f"config.json (llada-moe): field 'moe_layer_freq' is {freq}; only leading dense layers "
                        "(zeros before all ones) are supported.")
  else:
    raise ConfigError(f"config.json (llada-moe): field 'moe_layer_freq' is {freq!r}; expected a list of "
                      f"{layers} entries, 0 (dense layer) or 1 (MoE layer).")
  if first_dense == layers:
    raise ConfigError("config.json (llada-moe): 'moe_layer_freq' has no MoE layer; convert it as a dense model.")
  shared = hf.get("shared_expert_intermediate_size")
  if shared is not None and (isinstance(shared, bool) or not isinstance(shared, int) or shared <= 0):
    raise ConfigError(f"config.json (llada-moe): field 'shared_expert_intermediate_size' is {shared!r}; expected "
                      "null (no shared expert) or a positive width (the class placeholder -1 is not a model).")
  if hf.get("norm_topk_prob"):
    logging.warning("config.json (llada-moe): norm_topk_prob is true, but LLaDA-MoE's modeling code never "
                    "renormalises the routed weights; neither does the converted model.")
  fields = _moe_common(f)
  fields.update(
      mlp_hidden=f.integer("dense_intermediate_size", "dense-layer SwiGLU width") if first_dense
      else _unused_width(hf.get("dense_intermediate_size"), hf.get("expert_intermediate_size")),
      qk_norm=f.flag("qk_layernorm", False), n_experts=f.integer("num_experts", "routed experts"),
      experts_per_token=f.integer("num_experts_per_tok", "experts per token"),
      expert_hidden=f.integer("expert_intermediate_size", "expert SwiGLU width"),
      n_shared_experts=1 if shared else 0, shared_expert_hidden=shared or 0, first_k_dense=first_dense,
      router="softmax_topk", router_expert_bias=f.flag("moe_router_enable_expert_bias", False),
      router_renormalize=False, router_fp32=False)
  return fields


LLADA2_BLOCK = 32
"""The block length LLaDA2's `generate` decodes with (decoding_modes.md §6); config.json has no such field,
so converted LLaDA2 models are block-causal with blocks of 32 (change `attention_block_size` to taste)."""


def llada2_fields(hf: dict[str, Any]) -> dict[str, Any]:
  """LLaDA2.x config.json (`LLaDA2MoeConfig`, models_2026.md §3.1, §8.2) -> ModelConfig fields: block-causal
  (blocks of `LLADA2_BLOCK`), per-head QK norm, sigmoid group-limited router with its selection bias,
  renormalised (when k > 1, as the HF code does whatever norm_topk_prob says) and scaled, fp32 router."""
  f = _Fields(hf, "llada2")
  f.refuse("use_bias", (False,), "Biases on the output and MLP projections are not supported.")
  f.refuse("use_qk_norm", (True,), "LLaDA2 models normalise q and k per head.")
  f.refuse("num_nextn_predict_layers", (0,), "Multi-token-prediction layers are not supported.")
  if hf.get("score_function", "sigmoid") not in ("sigmoid", None):
    logging.warning("config.json (llada2): score_function=%r is ignored: the LLaDA2 code always uses the "
                    "sigmoid router, and so does the converted model.", hf.get("score_function"))
  k = f.integer("num_experts_per_tok", "experts per token")
  shared = hf.get("num_shared_experts")
  shared = 0 if shared is None else shared
  if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
    raise ConfigError(f"config.json (llada2): field 'num_shared_experts' is {shared!r}; expected an integer >= 0.")
  first_dense = hf.get("first_k_dense_replace", 0) or 0
  if isinstance(first_dense, bool) or not isinstance(first_dense, int) or first_dense < 0:
    raise ConfigError(f"config.json (llada2): field 'first_k_dense_replace' is {first_dense!r}; expected an "
                      "integer >= 0.")
  expert_hidden = f.integer("moe_intermediate_size", "expert SwiGLU width")
  scale = f.number("routed_scaling_factor", "routed weight scale") if f.has("routed_scaling_factor") else 1.0
  fields = _moe_common(f)
  fields.update(
      mlp_hidden=f.integer("intermediate_size", "dense-layer SwiGLU width"), qkv_bias=f.flag("use_qkv_bias", False),
      qk_norm=True, attention_block_size=LLADA2_BLOCK, n_experts=f.integer("num_experts", "routed experts"),
      experts_per_token=k, expert_hidden=expert_hidden, n_shared_experts=shared,
      shared_expert_hidden=expert_hidden if shared else 0, first_k_dense=first_dense, router="sigmoid_group",
      router_renormalize=k > 1, router_groups=f.integer("n_group", "expert groups", default=1),
      router_topk_groups=f.integer("topk_group", "groups kept per token", default=1),
      routed_scaling_factor=scale, router_fp32=True)
  return fields
_DG_LAYER_TYPES = {"sliding_attention": "s", "full_attention": "g"}


def _dg_rope(f: _Fields, layer_type: str) -> tuple[float, float]:
  """(θ, proportional fraction) of one layer type from `text_config.rope_parameters`."""
  params = f.required("rope_parameters", "RoPE settings per layer type")
  entry = params.get(layer_type) if isinstance(params, dict) else None
  if not isinstance(entry, dict):
    raise ConfigError(f"config.json (diffusion_gemma): field 'text_config.rope_parameters.{layer_type}' is missing "
                      f"or not an object; got {entry!r}.")
  where = f"text_config.rope_parameters.{layer_type}"
  kind = entry.get("rope_type", "default")
  allowed = ("default",) if layer_type == "sliding_attention" else ("default", "proportional")
  if kind not in allowed:
    raise ConfigError(f"config.json (diffusion_gemma): field '{where}.rope_type' is {kind!r}; expected "
                      f"{' or '.join(map(repr, allowed))} (RoPE scaling is not supported).")
  if entry.get("factor", 1.0) != 1.0:
    raise ConfigError(f"config.json (diffusion_gemma): field '{where}.factor' is {entry['factor']!r}; expected 1.0.")
  theta = entry.get("rope_theta")
  if isinstance(theta, bool) or not isinstance(theta, (int, float)):
    raise ConfigError(f"config.json (diffusion_gemma): field '{where}.rope_theta' must be a number, got {theta!r}.")
  fraction = entry.get("partial_rotary_factor", 1.0)
  if kind == "default" and fraction != 1.0:
    raise ConfigError(f"config.json (diffusion_gemma): field '{where}.partial_rotary_factor' is {fraction!r} with "
                      "rope_type 'default'; only full RoPE is supported there (proportional RoPE on full layers).")
  return float(theta), float(fraction)


def diffusion_gemma_fields(hf: dict[str, Any]) -> dict[str, Any]:
  """DiffusionGemma config.json (text_config of the Gemma-4 text stack) -> ModelConfig fields.

  Text only: `vision_config` is not read and the vision tensors are skipped. The encoder and decoder
  share every text weight, which needs `tie_word_embeddings` true (false unties the encoder too).
  """
  top = _Fields(hf, "diffusion_gemma")
  if not top.flag("tie_word_embeddings", True):
    raise ConfigError("config.json (diffusion_gemma): field 'tie_word_embeddings' is false; expected true (it also "
                      "ties the encoder's text weights to the decoder's, which our one stack assumes).")
  text = top.required("text_config", "the text model's settings")
  if not isinstance(text, dict):
    raise ConfigError(f"config.json (diffusion_gemma): field 'text_config' must be an object, got {text!r}.")
  f = _Fields(text, "diffusion_gemma")
  f.refuse("hidden_activation", ("gelu_pytorch_tanh",), "The feed-forwards are GeGLU with tanh-approximated GELU.")
  f.refuse("attention_bias", (False,), "Attention biases are not supported.")
  f.refuse("use_bidirectional_attention", ("vision",), "Only the text path is converted, where 'vision' means a "
           "causal encoder; 'all' (a bidirectional encoder with window W//2+1) is not supported.")
  f.refuse("tie_word_embeddings", (True,), "The LM head must be tied to model.decoder.embed_tokens.")
  n_layers = f.integer("num_hidden_layers", "number of layers")
  types = f.required("layer_types", "attention kind of every layer")
  if not isinstance(types, list) or len(types) != n_layers or any(t not in _DG_LAYER_TYPES for t in types):
    raise ConfigError(f"config.json (diffusion_gemma): field 'text_config.layer_types' must list {n_layers} entries "
                      f"from {sorted(_DG_LAYER_TYPES)}, got {types!r}.")
  pattern = "".join(_DG_LAYER_TYPES[t] for t in types)
  n_heads = f.integer("num_attention_heads", "query heads")
  head_dim = f.integer("head_dim", "sliding layers' head width")
  n_kv_heads = f.integer("num_key_value_heads", "sliding layers' key/value heads")
  per_layer = f.required("per_layer_config", "head_dim and num_key_value_heads of the full layers")
  if not isinstance(per_layer, dict):
    raise ConfigError(f"config.json (diffusion_gemma): field 'text_config.per_layer_config' must be an object, got "
                      f"{per_layer!r}.")
  global_dims = set()
  for index, kind in enumerate(pattern):
    entry = per_layer.get(str(index), per_layer.get(index))
    dims = (head_dim, n_kv_heads)
    if entry is not None:
      if not isinstance(entry, dict):
        raise ConfigError(f"config.json (diffusion_gemma): field 'text_config.per_layer_config.{index}' must be an "
                          f"object, got {entry!r}.")
      unknown = sorted(set(entry) - {"head_dim", "num_key_value_heads"})
      if unknown:
        raise ConfigError(f"config.json (diffusion_gemma): field 'text_config.per_layer_config.{index}' sets "
                          f"{unknown}; only head_dim and num_key_value_heads may differ per layer.")
      dims = (entry.get("head_dim", head_dim), entry.get("num_key_value_heads", n_kv_heads))
    if kind == "g":
      global_dims.add(dims)
    elif dims != (head_dim, n_kv_heads):
      raise ConfigError(f"config.json (diffusion_gemma): field 'text_config.per_layer_config.{index}' changes a "
                        f"sliding layer to head_dim/num_key_value_heads {dims}; sliding layers must use the text "
                        f"config's ({head_dim}, {n_kv_heads}).")
  if len(global_dims) != 1:
    raise ConfigError(f"config.json (diffusion_gemma): the full_attention layers have head_dim/num_key_value_heads "
                      f"{sorted(global_dims)} in 'text_config.per_layer_config'; expected one shared setting.")
  ((global_head_dim, global_kv_heads),) = global_dims
  theta, sliding_fraction = _dg_rope(f, "sliding_attention")
  global_theta, global_fraction = _dg_rope(f, "full_attention")
  del sliding_fraction
  vocab = f.integer("vocab_size", "embedding rows")
  softcap = text.get("final_logit_softcapping", 30.0)  # a class constant in transformers 5.23, not serialized
  return dict(
      d_model=f.integer("hidden_size", "hidden size"), n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
      head_dim=head_dim, mlp_hidden=f.integer("intermediate_size", "dense GeGLU width (also self-conditioning)"),
      vocab_size=vocab, norm_eps=f.number("rms_norm_eps", "RMSNorm epsilon"), rope_theta=theta, qk_norm=True,
      tied_embeddings=True, causal=True, logit_shift=0, layer_pattern=pattern,
      sliding_window=f.integer("sliding_window", "sliding-window width W") if "s" in pattern else None,
      global_head_dim=global_head_dim, global_kv_heads=global_kv_heads, global_rope_theta=global_theta,
      global_rope_fraction=global_fraction, global_k_eq_v=True, attention_scale=1.0, v_norm=True,
      mlp_activation="gelu_tanh", sandwich_norms=True, moe_with_dense_mlp=True, router="gemma",
      router_renormalize=True, router_fp32=False, n_experts=f.integer("num_experts", "routed experts"),
      experts_per_token=f.integer("top_k_experts", "experts per token"),
      expert_hidden=f.integer("moe_intermediate_size", "expert width"), layer_scalar=True, embed_scale=True,
      final_logit_softcap=None if softcap is None else float(softcap), self_conditioning=True, norm_fp32_weight=True,
      eos_token_id=f.token("eos_token_id", vocab), bos_token_id=f.token("bos_token_id", vocab),
      pad_token_id=f.token("pad_token_id", vocab))


def model_config(arch: str, hf: dict[str, Any], name: str,
                 overrides: hf_qwen3.Overrides = hf_qwen3.Overrides()) -> ModelConfig:
  """Our ModelConfig for family `arch` ("auto" detects it) from its config.json dict; `overrides` (block size,
  mask id) apply to the Qwen3-layout diffusion variants only (converters.hf_qwen3)."""
  if not isinstance(hf, dict):
    raise ConfigError("config.json must hold a JSON object.")
  if arch == "auto":
    arch = detect_arch(hf)
  if arch not in ARCHS:
    raise ConfigError(f"Unknown arch {arch!r}; expected one of auto, {', '.join(ARCHS)}.")
  if arch not in hf_qwen3.ARCHS and (overrides.block_size is not None or overrides.mask_token_id is not None):
    raise ConfigError(f"block_size and mask_token_id apply to the Qwen3-layout diffusion variants "
                      f"({', '.join(hf_qwen3.ARCHS[1:])}), not to {arch}.")
  if arch in ("llada", "mmada"):
    fields = llada_fields(hf, arch)
  elif arch == "llada-moe":
    fields = llada_moe_fields(hf)
  elif arch == "llada2":
    fields = llada2_fields(hf)
  elif arch == "diffusion_gemma":
    fields = diffusion_gemma_fields(hf)
  elif arch in hf_qwen3.ARCHS:
    fields = hf_qwen3.qwen3_fields(arch, hf_llama_like_fields(hf, arch), hf, overrides)
  else:
    fields = hf_llama_like_fields(hf, arch)
  try:
    return ModelConfig(name=name, **fields)
  except ConfigError as e:
    raise ConfigError(f"config.json ({arch}) describes an invalid model: {e}") from None
