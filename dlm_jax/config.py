"""Model configuration: one frozen, hashable, validated dataclass for every supported model.

The dense architectures (LLaDA, MMaDA, Dream, LLaMA-3, Qwen2.5, SmolLM2) and the mixture-of-experts DLMs
(LLaDA-MoE, LLaDA2.x) differ only in the values held here; see ../shared/reference/models.md §1 and §5
and models_2026.md §1–§3 for the numbers used by the presets.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

_SPECIAL_TOKEN_FIELDS = ("mask_token_id", "eos_token_id", "eot_token_id", "bos_token_id", "pad_token_id")


class ConfigError(ValueError):
  """A configuration value is invalid; the message says which field and what to change."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Hyper-parameters of the shared pre-norm Transformer.

  Attributes:
    name: free-form label (preset name or source checkpoint).
    d_model: residual width D.
    n_layers: number of blocks L.
    n_heads: query heads N.
    n_kv_heads: key/value heads K; N must be a multiple of K (GQA when K < N).
    head_dim: per-head width H (q/k/v projections map D -> N*H and K*H).
    mlp_hidden: SwiGLU hidden width F.
    vocab_size: embedding and LM-head rows V.
    norm_eps: RMSNorm epsilon.
    rope_theta: RoPE base θ.
    rope_fp32: rotate q/k in float32 and cast back (LLaDA, MMaDA); otherwise the fp32 cos/sin tables
      are cast to the activation dtype and the rotation happens there (Dream, Qwen2, Llama in HF).
    qkv_bias: q/k/v projections carry a bias (Dream, Qwen2).
    tied_embeddings: the LM head reuses the token embedding (SmolLM2).
    causal: causal attention (autoregressive baselines); bidirectional otherwise (DLMs).
    attention_block_size: None (the default) leaves attention as `causal` says; an int B makes it
      block-causal: the query at absolute sequence index i sees key j iff j // B <= i // B, i.e.
      bidirectional inside a block and causal across blocks, on a grid of blocks of B positions counted
      from position 0, the prompt included (LLaDA2.x, SDAR and dInfer block diffusion). The last block
      may be shorter. With a KV cache the query index is the call's cache offset plus its row, so a call
      whose queries are block [s, e) sees the cached keys of every block up to its own. Needs
      causal=False.
    logit_shift: 1 when the output at position i predicts token i+1 (Dream, ARMs), 0 when it
      predicts token i (LLaDA, MMaDA).
    qk_norm: RMSNorm (weight [H], eps `norm_eps`) over each query and key head after the projection and
      before RoPE (LLaDA-MoE `q_norm`/`k_norm`, LLaDA2.x `query_layernorm`/`key_layernorm`).
    rotary_dim: None rotates all H dims of each head; an even d_r < H rotates only the leading d_r dims
      (rotate-half inside them, inv_freq_j = θ^(−2j/d_r)) and passes the rest through — HF's
      `partial_rotary_factor` f gives d_r = int(H·f) (LLaDA2.x: 64 of 128).
    n_experts: routed experts E per mixture-of-experts layer; 0 (the default) makes every layer's
      feed-forward the dense SwiGLU of width `mlp_hidden`.
    experts_per_token: top-k experts each token is sent to (1 <= k <= E); 0 when n_experts is 0.
    expert_hidden: SwiGLU hidden width of each routed expert; 0 when n_experts is 0.
    n_shared_experts: experts every token always passes through (their outputs added unweighted to the
      routed mixture, no gate), stored as one SwiGLU of width n_shared_experts·shared_expert_hidden.
    shared_expert_hidden: hidden width of each shared expert (required > 0 iff n_shared_experts > 0).
    first_k_dense: the first k layers keep the dense SwiGLU (width `mlp_hidden`) and the other
      n_layers − k are MoE layers (LLaDA2.x `first_k_dense_replace` = 1). `mlp_hidden` is unused when
      first_k_dense is 0 in an MoE model.
    router: how the router's logits r = x·W_r [E] choose and weight experts —
      "softmax_topk" (LLaDA-MoE, OLMoE, Qwen-MoE): p = softmax(r); the k largest p are chosen and their p
      are the weights (renormalised only when `router_renormalize`);
      "sigmoid_group" (LLaDA2.x, DeepSeek-V3): s = sigmoid(r); selection scores s + `router.score_bias`
      (a per-expert correction bias used for the choice only); the E experts form `router_groups`
      contiguous groups, a group's score is the sum of its two best selection scores, only the best
      `router_topk_groups` groups stay eligible, the k best eligible experts are chosen; weights are their
      unbiased s, renormalised when `router_renormalize`, times `routed_scaling_factor`.
    router_expert_bias: "softmax_topk" only: a per-expert bias [E] (`mlp.router.score_bias`) is added to
      the softmax probabilities before the top-k and stays in the chosen weights (LLaDA-MoE with
      `moe_router_enable_expert_bias`; whether the released checkpoints set it is UNVERIFIED). The
      "sigmoid_group" router always has its selection-only bias.
    router_renormalize: renormalise the k chosen weights to sum to one, dividing by (their sum + 1e-20)
      for either router (OLMoE/LLaDA-MoE: False; LLaDA2.x: True).
    router_groups: expert groups for "sigmoid_group" (HF `n_group`); must divide E into groups of >= 2.
    router_topk_groups: groups kept per token for "sigmoid_group" (HF `topk_group`); the kept groups must
      hold at least k experts.
    routed_scaling_factor: multiplies the routed weights (LLaDA2.x 2.5); must be 1 for "softmax_topk".
    router_fp32: compute the router logits from float32 copies of the input and weight (LLaDA2.x,
      DeepSeek-V3); otherwise the logits are computed in the activation dtype and only the scores are
      float32 (LLaDA-MoE, OLMoE). The scores, choice and weights are float32 either way.
    capacity_factor: None (the default) routes exactly: every token reaches its k experts. A float c > 0
      caps each expert at ceil(c·M·k/E) of the M = B·T tokens of a call; an expert's slots go to tokens in
      (batch row, position) order, and a token's choice beyond the cap is dropped (weight 0; the shared
      experts and the residual still apply).
    mask_token_id, eos_token_id, eot_token_id, bos_token_id, pad_token_id: special token ids, or
      None when the model has no such token.
  """

  name: str
  d_model: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  head_dim: int
  mlp_hidden: int
  vocab_size: int
  norm_eps: float = 1e-5
  rope_theta: float = 10000.0
  rope_fp32: bool = False
  qkv_bias: bool = False
  tied_embeddings: bool = False
  causal: bool = False
  attention_block_size: int | None = None
  logit_shift: int = 0
  mask_token_id: int | None = None
  eos_token_id: int | None = None
  eot_token_id: int | None = None
  bos_token_id: int | None = None
  pad_token_id: int | None = None
  qk_norm: bool = False
  rotary_dim: int | None = None
  n_experts: int = 0
  experts_per_token: int = 0
  expert_hidden: int = 0
  n_shared_experts: int = 0
  shared_expert_hidden: int = 0
  first_k_dense: int = 0
  router: str = "softmax_topk"
  router_expert_bias: bool = False
  router_renormalize: bool = False
  router_groups: int = 1
  router_topk_groups: int = 1
  routed_scaling_factor: float = 1.0
  router_fp32: bool = True
  capacity_factor: float | None = None

  def __post_init__(self):
    for field in ("d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "mlp_hidden", "vocab_size"):
      value = getattr(self, field)
      if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"ModelConfig.{field} must be a positive integer, got {value!r}.")
    if self.n_heads % self.n_kv_heads:
      raise ConfigError(
          f"ModelConfig.n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads}); "
          "set n_kv_heads to a divisor of n_heads.")
    if not (isinstance(self.norm_eps, (int, float)) and 0 < self.norm_eps < 1):
      raise ConfigError(f"ModelConfig.norm_eps must be in (0, 1), got {self.norm_eps!r}.")
    if not (isinstance(self.rope_theta, (int, float)) and self.rope_theta > 1):
      raise ConfigError(f"ModelConfig.rope_theta must be a number > 1, got {self.rope_theta!r}.")
    if self.head_dim % 2:
      raise ConfigError(f"ModelConfig.head_dim must be even for rotate-half RoPE, got {self.head_dim}.")
    if self.logit_shift not in (0, 1):
      raise ConfigError(f"ModelConfig.logit_shift must be 0 or 1, got {self.logit_shift!r}.")
    for field in ("rope_fp32", "qkv_bias", "tied_embeddings", "causal", "qk_norm", "router_renormalize",
                  "router_fp32", "router_expert_bias"):
      if not isinstance(getattr(self, field), bool):
        raise ConfigError(f"ModelConfig.{field} must be a bool, got {getattr(self, field)!r}.")
    block = self.attention_block_size
    if block is not None:
      if isinstance(block, bool) or not isinstance(block, int) or block <= 0:
        raise ConfigError(f"ModelConfig.attention_block_size must be None or a positive integer, got {block!r}.")
      if self.causal:
        raise ConfigError(
            f"ModelConfig.attention_block_size={block} (block-causal attention) cannot be combined with "
            "causal=True; set causal=False for block-causal attention, or attention_block_size=None for "
            "token-causal attention.")
    rotary = self.rotary_dim
    if rotary is not None and (isinstance(rotary, bool) or not isinstance(rotary, int) or rotary <= 0
                               or rotary % 2 or rotary > self.head_dim):
      raise ConfigError(f"ModelConfig.rotary_dim must be None or an even integer in [2, head_dim={self.head_dim}], "
                        f"got {rotary!r}.")
    self._check_experts()
    for field in _SPECIAL_TOKEN_FIELDS:
      value = getattr(self, field)
      if value is None:
        continue
      if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < self.vocab_size:
        raise ConfigError(
            f"ModelConfig.{field} must be None or an id in [0, vocab_size={self.vocab_size}), got {value!r}.")

  def _check_experts(self) -> None:
    for field in ("n_experts", "experts_per_token", "expert_hidden", "n_shared_experts", "shared_expert_hidden",
                  "first_k_dense", "router_groups", "router_topk_groups"):
      value = getattr(self, field)
      if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"ModelConfig.{field} must be a non-negative integer, got {value!r}.")
    if self.router not in ("softmax_topk", "sigmoid_group"):
      raise ConfigError(f"ModelConfig.router must be 'softmax_topk' or 'sigmoid_group', got {self.router!r}.")
    scale = self.routed_scaling_factor
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale <= 0:
      raise ConfigError(f"ModelConfig.routed_scaling_factor must be a positive number, got {scale!r}.")
    capacity = self.capacity_factor
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, (int, float))
                                 or capacity <= 0):
      raise ConfigError(f"ModelConfig.capacity_factor must be None (exact routing) or a positive number, "
                        f"got {capacity!r}.")
    e = self.n_experts
    if e == 0:
      moe_only = {"experts_per_token": 0, "expert_hidden": 0, "n_shared_experts": 0, "shared_expert_hidden": 0,
                  "first_k_dense": 0, "router": "softmax_topk", "router_expert_bias": False, "router_renormalize": False, "router_groups": 1,
                  "router_topk_groups": 1, "routed_scaling_factor": 1.0, "router_fp32": True,
                  "capacity_factor": None}
      for field, default in moe_only.items():
        if getattr(self, field) != default:
          raise ConfigError(f"ModelConfig.{field}={getattr(self, field)!r} needs a mixture-of-experts model; "
                            f"set n_experts > 0, or leave {field} at {default!r} for a dense model.")
      return
    if not 1 <= self.experts_per_token <= e:
      raise ConfigError(f"ModelConfig.experts_per_token must be in [1, n_experts={e}], got "
                        f"{self.experts_per_token}.")
    if self.expert_hidden <= 0:
      raise ConfigError(f"ModelConfig.expert_hidden must be positive when n_experts={e}, got {self.expert_hidden}.")
    if (self.n_shared_experts > 0) != (self.shared_expert_hidden > 0):
      raise ConfigError(
          f"ModelConfig.n_shared_experts ({self.n_shared_experts}) and shared_expert_hidden "
          f"({self.shared_expert_hidden}) must both be positive (shared experts) or both 0 (none).")
    if self.first_k_dense >= self.n_layers:
      raise ConfigError(f"ModelConfig.first_k_dense ({self.first_k_dense}) must be below n_layers "
                        f"({self.n_layers}); use n_experts=0 for an all-dense model.")
    if self.router_expert_bias and self.router != "softmax_topk":
      raise ConfigError("ModelConfig.router_expert_bias applies to router='softmax_topk' only; the "
                        "'sigmoid_group' router always has its selection bias.")
    if self.router == "softmax_topk":
      if (self.router_groups, self.router_topk_groups, self.routed_scaling_factor) != (1, 1, 1.0):
        raise ConfigError("ModelConfig.router_groups, router_topk_groups and routed_scaling_factor apply to "
                          "router='sigmoid_group' only; leave them at 1, 1 and 1.0 for 'softmax_topk'.")
      return
    groups, kept = self.router_groups, self.router_topk_groups
    if groups < 1 or e % groups or e // groups < 2:
      raise ConfigError(f"ModelConfig.router_groups ({groups}) must divide n_experts ({e}) into groups of at "
                        "least 2 experts.")
    if not 1 <= kept <= groups or kept * (e // groups) < self.experts_per_token:
      raise ConfigError(
          f"ModelConfig.router_topk_groups ({kept}) must be in [1, router_groups={groups}] and the kept groups "
          f"({kept} x {e // groups} experts) must hold experts_per_token ({self.experts_per_token}) experts.")

  @property
  def is_moe(self) -> bool:
    """True when the feed-forward of the layers after `first_k_dense` is a mixture of experts."""
    return self.n_experts > 0

  @property
  def rope_dim(self) -> int:
    """d_r: the leading dims of each head that RoPE rotates (`rotary_dim`, or all H)."""
    return self.head_dim if self.rotary_dim is None else self.rotary_dim

  @property
  def heads_per_kv(self) -> int:
    """G: query heads that share one key/value head."""
    return self.n_heads // self.n_kv_heads

  @property
  def is_diffusion(self) -> bool:
    """True for masked diffusion models (they have a mask token and attend bidirectionally)."""
    return self.mask_token_id is not None and not self.causal

  def replace(self, **changes: Any) -> ModelConfig:
    """Returns a copy with `changes` applied (and validated)."""
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  def to_json(self) -> str:
    return json.dumps(self.to_dict(), indent=2, sort_keys=True)

  @classmethod
  def from_dict(cls, values: dict[str, Any]) -> ModelConfig:
    """Builds a config from a dict written by `to_dict`; unknown or missing keys are errors."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
      raise ConfigError(f"Unknown ModelConfig keys {unknown}; expected a subset of {sorted(known)}.")
    required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}
    missing = sorted(required - set(values))
    if missing:
      raise ConfigError(f"ModelConfig is missing required keys {missing}.")
    return cls(**values)

  @classmethod
  def from_json(cls, text: str) -> ModelConfig:
    return cls.from_dict(json.loads(text))


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
    "tiny-smollm2": _tiny("tiny-smollm2", n_heads=6, n_kv_heads=2, head_dim=8, tied_embeddings=True, causal=True,
                          logit_shift=1, eos_token_id=1, bos_token_id=0, pad_token_id=1),
}


def preset(name: str) -> ModelConfig:
  """Returns the named preset; the error lists the known names."""
  try:
    return PRESETS[name]
  except KeyError:
    raise ConfigError(f"Unknown preset {name!r}; choose one of {sorted(PRESETS)}.") from None
