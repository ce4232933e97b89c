"""Presets: the `ModelConfig` of every supported checkpoint (real sizes from ../shared/reference/models.md
§1 and §5 and models_2026.md §1–§3) and the tiny random configs the tests use."""

from __future__ import annotations

from typing import Any

from dlm_jax.config.model_config import ConfigError, ModelConfig


def _llada_like(name: str, vocab_size: int) -> ModelConfig:
  return ModelConfig(
      name=name, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32, head_dim=128, mlp_hidden=12288,
      vocab_size=vocab_size, norm_eps=1e-5, rope_theta=500000.0, rope_fp32=True, causal=False, logit_shift=0,
      mask_token_id=126336, eos_token_id=126081, eot_token_id=126348, bos_token_id=126080, pad_token_id=126081)


def _qwen25_7b_like(name: str, causal: bool) -> ModelConfig:
  return ModelConfig(
      name=name, d_model=3584, n_layers=28, n_heads=28, n_kv_heads=4, head_dim=128, mlp_hidden=18944,
      vocab_size=152064, norm_eps=1e-6, rope_theta=1_000_000.0, qkv_bias=True, causal=causal, logit_shift=1,
      mask_token_id=None if causal else 151666, eos_token_id=151643, eot_token_id=151645,
      bos_token_id=None if causal else 151643, pad_token_id=151643)


_LING_TOKENS = dict(mask_token_id=156895, eos_token_id=156892, pad_token_id=156892)  # models_2026.md §1


def _llada2(name: str, **dims: Any) -> ModelConfig:
  """LLaDA2.x (Ling 2.0 / BailingMoeV2 converted to block diffusion): models_2026.md §3.1, §3.4, §3.5."""
  return ModelConfig(
      name=name, head_dim=128, n_kv_heads=4, vocab_size=157184, norm_eps=1e-6, rope_theta=600000.0,
      rotary_dim=64, qk_norm=True, attention_block_size=32, n_experts=256, experts_per_token=8,
      n_shared_experts=1, first_k_dense=1, router="sigmoid_group", router_renormalize=True, router_groups=8,
      router_topk_groups=4, routed_scaling_factor=2.5, router_fp32=True, **_LING_TOKENS, **dims)


def _diffusion_gemma(name: str, **dims: Any) -> ModelConfig:
  """DiffusionGemma (the Gemma-4 26B-A4B text stack): models_2026.md §8.3 and transformers'
  `DiffusionGemmaTextConfig`; 5 sliding : 1 global layers, the last one global."""
  values = dict(
      name=name, norm_eps=1e-6, rope_theta=10000.0, qk_norm=True, tied_embeddings=True, causal=True,
      logit_shift=0, global_rope_theta=1_000_000.0, global_rope_fraction=0.25, global_k_eq_v=True,
      attention_scale=1.0, v_norm=True, mlp_activation="gelu_tanh", sandwich_norms=True, moe_with_dense_mlp=True,
      router="gemma", router_renormalize=True, router_fp32=False, layer_scalar=True, embed_scale=True,
      final_logit_softcap=30.0, self_conditioning=True, norm_fp32_weight=True, pad_token_id=0, eos_token_id=1,
      bos_token_id=2)
  values.update(dims)
  return ModelConfig(**values)


def _qwen3(name: str, **dims: Any) -> ModelConfig:
  """Qwen3 dense (head_dim 128, θ 1e6, eps 1e-6, per-head QK norm, vocab 151936) and the diffusion LMs built on
  it: small_dlms.md §2.3 (sizes), §2.4 (ids: <|endoftext|> 151643, <|im_end|> 151645, mask 151669), §3, §5."""
  values = dict(name=name, head_dim=128, vocab_size=151936, norm_eps=1e-6, rope_theta=1_000_000.0, qk_norm=True,
                causal=False, logit_shift=0, mask_token_id=151669, eos_token_id=151645, eot_token_id=151645,
                bos_token_id=151643, pad_token_id=151643)
  values.update(dims)
  return ModelConfig(**values)


_QWEN3_06B = dict(d_model=1024, n_layers=28, n_heads=16, n_kv_heads=8, mlp_hidden=3072, tied_embeddings=True)
_SDAR = dict(n_kv_heads=8, attention_block_size=4, eos_token_id=151643)


def _tiny(name: str, **overrides: Any) -> ModelConfig:
  values = dict(name=name, d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, head_dim=16, mlp_hidden=128,
                vocab_size=256, norm_eps=1e-5, rope_theta=10000.0)
  values.update(overrides)
  return ModelConfig(**values)


PRESETS: dict[str, ModelConfig] = {
    # LLaDA-8B (Base and Instruct share the config): models.md §2.2.
    "llada-8b": _llada_like("llada-8b", vocab_size=126464),
    # MMaDA-8B: LLaDA-8B with the vocabulary resized to 126464 + 8192 image codes: models.md §4.2.
    "mmada-8b": _llada_like("mmada-8b", vocab_size=134656),
    # Dream-v0-7B: Qwen2.5-7B shapes, bidirectional, one-position logit shift: models.md §3.2.
    "dream-7b": _qwen25_7b_like("dream-7b", causal=False),
    # Autoregressive baselines: models.md §5, peers.md §6.
    "llama3-8b": ModelConfig(
        name="llama3-8b", d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128, mlp_hidden=14336,
        vocab_size=128256, norm_eps=1e-5, rope_theta=500000.0, causal=True, logit_shift=1,
        eos_token_id=128001, eot_token_id=128009, bos_token_id=128000, pad_token_id=128001),
    "qwen2.5-7b": _qwen25_7b_like("qwen2.5-7b", causal=True),
    "smollm2-135m": ModelConfig(
        name="smollm2-135m", d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64, mlp_hidden=1536,
        vocab_size=49152, norm_eps=1e-5, rope_theta=100000.0, tied_embeddings=True, causal=True, logit_shift=1,
        eos_token_id=2, eot_token_id=2, bos_token_id=1, pad_token_id=2),
    # LLaDA-MoE-7B-A1B: models_2026.md §1, §2. Verified: 16 layers, 64 experts top-8, softmax router in
    # fp32 on bf16 logits without renormalisation, per-head QK norm, the special ids. UNVERIFIED (secondary
    # sources or class defaults): hidden 2048, 16 kv heads, expert width 1024, θ 50000, full RoPE, eps 1e-5,
    # vocab 157184, no shared expert and no dense layer (mlp_hidden is then unused).
    "llada-moe-7b": ModelConfig(
        name="llada-moe-7b", d_model=2048, n_layers=16, n_heads=16, n_kv_heads=16, head_dim=128, mlp_hidden=1024,
        vocab_size=157184, norm_eps=1e-5, rope_theta=50000.0, qk_norm=True, n_experts=64, experts_per_token=8,
        expert_hidden=1024, router="softmax_topk", router_renormalize=False, router_fp32=False, **_LING_TOKENS),
    # LLaDA2.0-mini / LLaDA2.1-mini (same tensors): every value read in the hub config.json (vocab inferred).
    "llada2-mini": _llada2("llada2-mini", d_model=2048, n_layers=20, n_heads=16, mlp_hidden=5120, expert_hidden=512,
                           shared_expert_hidden=512),
    # LLaDA2.0-flash / 2.1-flash: only the router, 4 kv heads and head_dim 128 are verified; hidden 4096,
    # 32 layers, 32 heads, expert width 1024, dense width 9216 and θ/eps/rotary (as mini) are Ling-flash-2.0
    # values from secondary sources — UNVERIFIED.
    "llada2-flash": _llada2("llada2-flash", d_model=4096, n_layers=32, n_heads=32, mlp_hidden=9216,
                            expert_hidden=1024, shared_expert_hidden=1024),
    # iLLaDA-8B: only mask id 5 and LLaDA-8B API compatibility are published (models_2026.md §6); the
    # LLaDA-8B shapes and other special ids are assumed — UNVERIFIED.
    "illada-8b": _llada_like("illada-8b", vocab_size=126464).replace(name="illada-8b", mask_token_id=5),
    # DiffusionGemma 26B-A4B (google/diffusiongemma-26B-A4B-it), text stack only: models_2026.md §8.3.
    "diffusiongemma-26b-a4b": _diffusion_gemma(
        "diffusiongemma-26b-a4b", d_model=2816, n_layers=30, n_heads=16, n_kv_heads=8, head_dim=256,
        mlp_hidden=2112, vocab_size=262144, layer_pattern="sssssg" * 5, sliding_window=1024, global_head_dim=512,
        global_kv_heads=2, n_experts=128, experts_per_token=8, expert_hidden=704),
    # Qwen3-0.6B (autoregressive) and the dllm Tiny-A2D conversions of it: small_dlms.md §2.3, §3. A2D: the
    # model is bidirectional; the BD3LM one (and the TIDE students distilled from it, §4) decodes with
    # blocks of 32. The A2D and TIDE config.json files were not readable: their values are Qwen3-0.6B's,
    # inferred from dllm's conversion code (UNVERIFIED).
    "qwen3-0.6b": _qwen3("qwen3-0.6b", causal=True, logit_shift=1, mask_token_id=None, **_QWEN3_06B),
    "qwen3-0.6b-a2d-mdlm": _qwen3("qwen3-0.6b-a2d-mdlm", **_QWEN3_06B),
    "qwen3-0.6b-a2d-bd3lm": _qwen3("qwen3-0.6b-a2d-bd3lm", attention_block_size=32, **_QWEN3_06B),
    "tide-0.6b": _qwen3("tide-0.6b", attention_block_size=32, **_QWEN3_06B),
    # SDAR (JetLM/SDAR-*-Chat): Qwen3-Base dims, untied head, block-causal blocks of 4, eos 151643 (§5.2;
    # 4B and 8B read in config.json; 1.7B's config was not readable: Qwen3-1.7B's dims, untied from the
    # 4.06 GB file size — UNVERIFIED).
    "sdar-1.7b": _qwen3("sdar-1.7b", d_model=2048, n_layers=28, n_heads=16, mlp_hidden=6144, **_SDAR),
    "sdar-4b": _qwen3("sdar-4b", d_model=2560, n_layers=36, n_heads=32, mlp_hidden=9728, **_SDAR),
    "sdar-8b": _qwen3("sdar-8b", d_model=4096, n_layers=36, n_heads=32, mlp_hidden=12288, **_SDAR),
    # Tiny random configs for tests: same switches as the real models, a few thousand parameters.
    "tiny-llada": _tiny("tiny-llada", rope_fp32=True, mask_token_id=255, eos_token_id=1, eot_token_id=2,
                        bos_token_id=0, pad_token_id=1),
    "tiny-dream": _tiny("tiny-dream", n_kv_heads=2, qkv_bias=True, norm_eps=1e-6, rope_theta=1_000_000.0,
                        logit_shift=1, mask_token_id=255, eos_token_id=1, eot_token_id=2, bos_token_id=0,
                        pad_token_id=1),
    "tiny-llama": _tiny("tiny-llama", n_kv_heads=2, causal=True, logit_shift=1, eos_token_id=1, bos_token_id=0,
                        pad_token_id=1),
    "tiny-qwen2": _tiny("tiny-qwen2", n_kv_heads=1, qkv_bias=True, causal=True, logit_shift=1, eos_token_id=1,
                        bos_token_id=0, pad_token_id=1),
    "tiny-llada-moe": _tiny("tiny-llada-moe", qk_norm=True, n_experts=8, experts_per_token=2, expert_hidden=32,
                            router_fp32=False, mask_token_id=255, eos_token_id=1, pad_token_id=1),
    "tiny-llada2": _tiny("tiny-llada2", n_layers=3, n_kv_heads=2, norm_eps=1e-6, rope_theta=600000.0, rotary_dim=8,
                         qk_norm=True, attention_block_size=4, n_experts=8, experts_per_token=2, expert_hidden=16,
                         n_shared_experts=1, shared_expert_hidden=16, first_k_dense=1, router="sigmoid_group",
                         router_renormalize=True, router_groups=4, router_topk_groups=2, routed_scaling_factor=2.5,
                         mask_token_id=255, eos_token_id=1, pad_token_id=1),
    "tiny-diffusiongemma": _diffusion_gemma(
        "tiny-diffusiongemma", d_model=64, n_layers=5, n_heads=4, n_kv_heads=2, head_dim=16, mlp_hidden=96,
        vocab_size=256, layer_pattern="ssgsg", sliding_window=4, global_head_dim=32, global_kv_heads=1,
        n_experts=8, experts_per_token=2, expert_hidden=32),
    "tiny-smollm2": _tiny("tiny-smollm2", n_heads=6, n_kv_heads=2, head_dim=8, tied_embeddings=True, causal=True,
                          logit_shift=1, eos_token_id=1, bos_token_id=0, pad_token_id=1),
}


def preset(name: str) -> ModelConfig:
  """Returns the named preset; the error lists the known names."""
  try:
    return PRESETS[name]
  except KeyError:
    raise ConfigError(f"Unknown preset {name!r}; choose one of {sorted(PRESETS)}.") from None
