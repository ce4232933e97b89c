"""Model configuration: one frozen, hashable, validated dataclass for every supported model.

The dense architectures (LLaDA, MMaDA, Dream, LLaMA-3, Qwen2.5, SmolLM2), the mixture-of-experts DLMs
(LLaDA-MoE, LLaDA2.x) and DiffusionGemma differ only in the values held here; see
../shared/reference/models.md §1 and §5 and models_2026.md §1–§3 for the numbers used by the presets.

The fields come in groups, one per feature, each documented next to the field and validated by one
method: the shape, attention, rotary positions, norms / embedding / output, special tokens, the
feed-forward and its mixture of experts, sliding and global layers, the Gemma-4 block, and compute
options. A field of a feature a model does not have keeps its default; setting it anyway is refused with
the feature it belongs to.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from dlm_jax.config import limits as config_limits

_SHAPE_FIELDS = ("d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "mlp_hidden", "vocab_size")
_SPECIAL_TOKEN_FIELDS = ("mask_token_id", "eos_token_id", "eot_token_id", "bos_token_id", "pad_token_id")
_EXPERT_COUNT_FIELDS = ("n_experts", "experts_per_token", "expert_hidden", "n_shared_experts", "shared_expert_hidden",
                        "first_k_dense", "router_groups", "router_topk_groups")


class ConfigError(ValueError):
  """A configuration value is invalid; the message says which field and what to change."""


def _check_optional_positive(field: str, value: Any) -> None:
  if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
    raise ConfigError(f"ModelConfig.{field} must be None or a positive number, got {value!r}.")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Hyper-parameters of the shared pre-norm Transformer, grouped by feature (module docstring). Each field's
  meaning is documented beside it; the axis letters are those of `dlm_jax.model.attention`."""

  # The shape.
  name: str
  """Free-form label (preset name or source checkpoint)."""
  d_model: int
  """Residual width D."""
  n_layers: int
  """Number of layers L."""
  n_heads: int
  """Query heads N."""
  n_kv_heads: int
  """Key/value heads K; N must be a multiple of K (GQA when K < N)."""
  head_dim: int
  """Per-head width H (q/k/v projections map D -> N·H and K·H); even (rotate-half RoPE)."""
  mlp_hidden: int
  """Hidden width F of the dense gated feed-forward."""
  vocab_size: int
  """Embedding and LM-head rows V."""

  # Attention.
  causal: bool = False
  """Causal attention (autoregressive baselines, DiffusionGemma's encoder); bidirectional otherwise (DLMs)."""
  attention_block_size: int | None = None
  """None leaves attention as `causal` says; an int B makes it block-causal: the query at absolute sequence
  index i sees key j iff j // B <= i // B, i.e. bidirectional inside an attention block and causal across
  them, on a grid of B positions counted from position 0, the prompt included (LLaDA2.x, SDAR and dInfer
  block diffusion, whose decoding blocks are these attention blocks). The last one may be shorter. With a
  KV cache the query index is the call's cache offset plus its row, so a call whose queries are the
  attention block [s, e) sees the cached keys of every block up to its own. Needs causal=False."""
  qkv_bias: bool = False
  """The q/k/v projections carry a bias (Dream, Qwen2)."""
  qk_norm: bool = False
  """RMSNorm (weight [H], eps `norm_eps`) over each query and key head after the projection and before RoPE
  (LLaDA-MoE `q_norm`/`k_norm`, LLaDA2.x `query_layernorm`/`key_layernorm`)."""
  v_norm: bool = False
  """A weightless RMSNorm over each value head (Gemma 4)."""
  attention_scale: float | None = None
  """Multiplier of q·k; None means 1/√H (DiffusionGemma: 1.0)."""

  # Rotary positions.
  rope_theta: float = 10000.0
  """RoPE base θ."""
  rope_fp32: bool = False
  """Rotate q/k in float32 and cast back (LLaDA, MMaDA); otherwise the float32 cos/sin tables are cast to
  the activation dtype and the rotation happens there (Dream, Qwen2, Llama in HF)."""
  rotary_dim: int | None = None
  """None rotates all H dims of each head; an even d_r < H rotates only the leading d_r dims (rotate-half
  inside them, inv_freq_j = θ^(−2j/d_r)) and passes the rest through — HF's `partial_rotary_factor` f
  gives d_r = int(H·f) (LLaDA2.x: 64 of 128)."""

  # Norms, embedding and output.
  norm_eps: float = 1e-5
  """RMSNorm epsilon, in (0, 1)."""
  norm_fp32_weight: bool = False
  """Every weighted RMSNorm multiplies by its weight in float32 and then casts to the activation dtype
  (Gemma 4); otherwise the normalised value is cast first (Llama, Qwen2, LLaDA). The two agree in float32."""
  tied_embeddings: bool = False
  """The LM head reuses the token embedding (SmolLM2)."""
  embed_scale: bool = False
  """Token embeddings are multiplied by √D, the factor cast to the parameter dtype first (bf16: √2816 =
  53.07 -> 53.0)."""
  final_logit_softcap: float | None = None
  """None, or c: logits = c·tanh(logits / c) in float32 (DiffusionGemma 30)."""
  logit_shift: int = 0
  """1 when the output at position i predicts token i+1 (Dream, ARMs), 0 when it predicts token i (LLaDA,
  MMaDA); `dlm_jax.config.logit_shift` is the one rule every reader of logits follows."""

  # Special tokens: an id in [0, V), or None when the model has no such token.
  mask_token_id: int | None = None
  """The mask token a masked diffusion model decodes from (None: no mask token, e.g. ARMs, DiffusionGemma)."""
  eos_token_id: int | None = None
  """End of sequence: a sampler that stops at EOS ends a row at its first EOS."""
  eot_token_id: int | None = None
  """End of turn of a chat template (LLaDA's `<|eot_id|>`; MMaDA's samplers may stop at it)."""
  bos_token_id: int | None = None
  """Beginning of sequence, for the tokenizers and chat templates that put one first."""
  pad_token_id: int | None = None
  """The padding id: what a sampler writes after a row stops (the EOS id when None)."""

  # The feed-forward and its mixture of experts.
  mlp_activation: str = "silu"
  """"silu" (SwiGLU) or "gelu_tanh" (GeGLU with the tanh approximation of GELU) for every gated feed-forward
  (dense MLP, experts, self-conditioning)."""
  n_experts: int = 0
  """Routed experts E per mixture-of-experts layer; 0 makes every layer's feed-forward the dense gated MLP
  of width `mlp_hidden`. Every field below up to `capacity_factor` needs E > 0."""
  experts_per_token: int = 0
  """Top-k experts each token is sent to (1 <= k <= E)."""
  expert_hidden: int = 0
  """Hidden width of each routed expert."""
  n_shared_experts: int = 0
  """Experts every token always passes through (their outputs added unweighted to the routed mixture, no
  gate), stored as one gated MLP of width n_shared_experts·shared_expert_hidden."""
  shared_expert_hidden: int = 0
  """Hidden width of each shared expert (> 0 iff n_shared_experts > 0)."""
  first_k_dense: int = 0
  """The first k layers keep the dense gated MLP (width `mlp_hidden`) and the other n_layers − k are MoE
  layers (LLaDA2.x `first_k_dense_replace` = 1). `mlp_hidden` is unused when first_k_dense is 0 in an MoE
  model without `moe_with_dense_mlp`."""
  router: str = "softmax_topk"
  """How the router's logits r = x·W_r [E] choose and weight experts. "softmax_topk" (LLaDA-MoE, OLMoE,
  Qwen-MoE): p = softmax(r); the k largest p are chosen and their p are the weights (renormalised only
  when `router_renormalize`). "sigmoid_group" (LLaDA2.x, DeepSeek-V3): s = sigmoid(r); selection scores s +
  `router.score_bias` (a per-expert correction bias used for the choice only); the E experts form
  `router_groups` contiguous groups, a group's score is the sum of its two best selection scores, only the
  best `router_topk_groups` groups stay eligible, the k best eligible experts are chosen; weights are
  their unbiased s, renormalised when `router_renormalize`, times `routed_scaling_factor`. "gemma"
  (Gemma 4 / DiffusionGemma): logits = (RMSNorm_noweight(h)·router.scale·D^(−1/2))·W_r, p = softmax
  (float32), the k largest p renormalised to sum to one (router_renormalize must be True), times
  router.per_expert_scale[e]; needs `moe_with_dense_mlp`."""
  router_expert_bias: bool = False
  """"softmax_topk" only: a per-expert bias [E] (`mlp.router.score_bias`) is added to the softmax
  probabilities before the top-k and stays in the chosen weights (LLaDA-MoE with
  `moe_router_enable_expert_bias`; whether the released checkpoints set it is UNVERIFIED). The
  "sigmoid_group" router always has its selection-only bias."""
  router_renormalize: bool = False
  """Renormalise the k chosen weights to sum to one, dividing by (their sum + 1e-20), for any router
  (OLMoE/LLaDA-MoE: False; LLaDA2.x and Gemma: True)."""
  router_groups: int = 1
  """Expert groups for "sigmoid_group" (HF `n_group`); must divide E into groups of >= 2."""
  router_topk_groups: int = 1
  """Groups kept per token for "sigmoid_group" (HF `topk_group`); the kept groups must hold at least k
  experts."""
  routed_scaling_factor: float = 1.0
  """Multiplies the routed weights (LLaDA2.x 2.5); must be 1 for "softmax_topk" and "gemma"."""
  router_fp32: bool = True
  """Compute the router logits from float32 copies of the input and weight (LLaDA2.x, DeepSeek-V3);
  otherwise the logits are computed in the activation dtype and only the scores are float32 (LLaDA-MoE,
  OLMoE). The scores, choice and weights are float32 either way."""
  capacity_factor: float | None = None
  """None routes exactly: every token reaches its k experts. A float c > 0 caps each expert at
  ceil(c·M·k/E) of the M = B·T tokens of a call; an expert's slots go to tokens in (batch row, position)
  order, and a token's choice beyond the cap is dropped (weight 0; the shared experts and the residual
  still apply)."""

  # Sliding and global layers (Gemma 4 / DiffusionGemma).
  layer_pattern: str | None = None
  """None makes every layer alike. A string of n_layers letters gives each layer's attention kind: "s" a
  sliding-window layer (width `sliding_window`; head_dim, n_kv_heads, rope_theta and rotary_dim as above)
  and "g" a global layer (its own `global_head_dim`, `global_kv_heads`, `global_rope_theta`,
  `global_rope_fraction`, and K = V when `global_k_eq_v`). Both letters must occur. The sliding layers
  are stored in the parameter tree's `blocks` and the global ones in `global_blocks` (see dlm_jax.model);
  statistics and biases keep one [L] axis in absolute layer order. Every field below needs a pattern."""
  sliding_window: int | None = None
  """W for the "s" layers: a causal query at sequence index i sees keys i−W+1..i; in a
  `forward(..., decoder=DecoderCall())` call the queries see the last W−1 cached keys before the call and
  all of the call's own keys. Required iff layer_pattern has an "s"."""
  global_head_dim: int | None = None
  """Head width of the "g" layers (DiffusionGemma: 512). Required iff layer_pattern has a "g"."""
  global_kv_heads: int | None = None
  """Key/value heads of the "g" layers (DiffusionGemma: 2). Required iff layer_pattern has a "g"."""
  global_rope_theta: float | None = None
  """RoPE θ of the "g" layers (DiffusionGemma: 1e6). Required iff layer_pattern has a "g"."""
  global_rope_fraction: float = 1.0
  """"Proportional" RoPE of the "g" layers (HF rope_type "proportional"): inv_freq_j = θ^(−2j/H) for
  j < int(f·H // 2) and 0 for the other pairs, rotate-half over the whole head (pairs j, j + H/2); 1.0 is
  plain full RoPE. Not `rotary_dim` (leading dims, exponent over d_r)."""
  global_k_eq_v: bool = False
  """The "g" layers have no v projection: V = the k projection (then `v_norm`), K = RoPE of its k_norm."""

  # The Gemma-4 block.
  sandwich_norms: bool = False
  """Gemma norms around the sub-layers: h = x + post_attn_norm(attn(attn_norm x)),
  out = h + post_ffn_norm(FFN(h)) with FFN starting from mlp_norm."""
  moe_with_dense_mlp: bool = False
  """Every layer has the dense gated MLP (width mlp_hidden) and the MoE in parallel (Gemma 4 MoE):
  FFN(h) = post_mlp_norm(MLP(mlp_norm h)) + post_moe_norm(MoE(moe_norm h)), the router reading h itself.
  Needs sandwich_norms, router "gemma" and first_k_dense 0."""
  layer_scalar: bool = False
  """Each layer's output (residual included) is multiplied by a learned scalar [1]."""
  self_conditioning: bool = False
  """The DiffusionGemma decoder's self-conditioning module (`self_conditioning.*`, a gated MLP of width
  mlp_hidden): a decoder call's input is RMSNorm_noweight(e + MLP(pre_norm(s))) with e = embed(tokens)·√D
  and s = softmax(previous logits)·E·√D (zeros when no logits are given)."""

  # Compute options (not architecture: every checkpoint runs either way).
  fused_projections: bool = False
  """q/k/v (and each gated MLP's gate/up) computed by one matmul over the kernels concatenated at trace
  time, then split. The parameters keep their layout; results differ by float rounding only. Layers whose
  value is their key projection (`global_k_eq_v`) keep separate q and k matmuls."""

  def __post_init__(self):
    self._check_shape()
    self._check_bools()
    self._check_rope()
    self._check_output()
    self._check_attention()
    self._check_feed_forward()
    self._check_gemma()
    self._check_layer_pattern()
    too_large = config_limits.size_error(self)
    if too_large:
      raise ConfigError(too_large + ".")
    self._check_special_tokens()

  def _check_shape(self) -> None:
    if not isinstance(self.name, str):
      raise ConfigError(f"ModelConfig.name must be a string, got {self.name!r}.")
    for field in _SHAPE_FIELDS:
      value = getattr(self, field)
      if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"ModelConfig.{field} must be a positive integer, got {value!r}.")
    if self.n_heads % self.n_kv_heads:
      raise ConfigError(
          f"ModelConfig.n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads}); "
          "set n_kv_heads to a divisor of n_heads.")

  def _check_bools(self) -> None:
    """Every field annotated `bool` holds a bool (JSON's 0 / 1 or "true" are refused)."""
    for field in dataclasses.fields(self):
      if field.type == "bool" and not isinstance(getattr(self, field.name), bool):
        raise ConfigError(f"ModelConfig.{field.name} must be a bool, got {getattr(self, field.name)!r}.")

  def _check_rope(self) -> None:
    if not (isinstance(self.rope_theta, (int, float)) and self.rope_theta > 1):
      raise ConfigError(f"ModelConfig.rope_theta must be a number > 1, got {self.rope_theta!r}.")
    if self.head_dim % 2:
      raise ConfigError(f"ModelConfig.head_dim must be even for rotate-half RoPE, got {self.head_dim}.")
    rotary = self.rotary_dim
    if rotary is not None and (isinstance(rotary, bool) or not isinstance(rotary, int) or rotary <= 0
                               or rotary % 2 or rotary > self.head_dim):
      raise ConfigError(f"ModelConfig.rotary_dim must be None or an even integer in [2, head_dim={self.head_dim}], "
                        f"got {rotary!r}.")

  def _check_output(self) -> None:
    """Norms, embedding and output."""
    if not (isinstance(self.norm_eps, (int, float)) and 0 < self.norm_eps < 1):
      raise ConfigError(f"ModelConfig.norm_eps must be in (0, 1), got {self.norm_eps!r}.")
    if self.logit_shift not in (0, 1):
      raise ConfigError(f"ModelConfig.logit_shift must be 0 or 1, got {self.logit_shift!r}.")
    _check_optional_positive("final_logit_softcap", self.final_logit_softcap)

  def _check_attention(self) -> None:
    _check_optional_positive("attention_scale", self.attention_scale)
    block = self.attention_block_size
    if block is None:
      return
    if isinstance(block, bool) or not isinstance(block, int) or block <= 0:
      raise ConfigError(f"ModelConfig.attention_block_size must be None or a positive integer, got {block!r}.")
    if self.causal:
      raise ConfigError(
          f"ModelConfig.attention_block_size={block} (block-causal attention) cannot be combined with "
          "causal=True; set causal=False for block-causal attention, or attention_block_size=None for "
          "token-causal attention.")

  def _check_special_tokens(self) -> None:
    for field in _SPECIAL_TOKEN_FIELDS:
      value = getattr(self, field)
      if value is None:
        continue
      if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < self.vocab_size:
        raise ConfigError(
            f"ModelConfig.{field} must be None or an id in [0, vocab_size={self.vocab_size}), got {value!r}.")

  def _check_feed_forward(self) -> None:
    """The feed-forward and its mixture of experts."""
    if self.mlp_activation not in ("silu", "gelu_tanh"):
      raise ConfigError(f"ModelConfig.mlp_activation must be 'silu' or 'gelu_tanh', got {self.mlp_activation!r}.")
    for field in _EXPERT_COUNT_FIELDS:
      value = getattr(self, field)
      if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"ModelConfig.{field} must be a non-negative integer, got {value!r}.")
    if self.router not in ("softmax_topk", "sigmoid_group", "gemma"):
      raise ConfigError(f"ModelConfig.router must be 'softmax_topk', 'sigmoid_group' or 'gemma', got "
                        f"{self.router!r}.")
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
    if self.router in ("softmax_topk", "gemma"):
      if (self.router_groups, self.router_topk_groups, self.routed_scaling_factor) != (1, 1, 1.0):
        raise ConfigError("ModelConfig.router_groups, router_topk_groups and routed_scaling_factor apply to "
                          "router='sigmoid_group' only; leave them at 1, 1 and 1.0 for 'softmax_topk' and 'gemma'.")
      if self.router == "gemma" and not (self.router_renormalize and self.moe_with_dense_mlp):
        raise ConfigError("ModelConfig.router='gemma' needs router_renormalize=True and moe_with_dense_mlp=True "
                          "(the Gemma-4 feed-forward); use 'softmax_topk' otherwise.")
      return
    groups, kept = self.router_groups, self.router_topk_groups
    if groups < 1 or e % groups or e // groups < 2:
      raise ConfigError(f"ModelConfig.router_groups ({groups}) must divide n_experts ({e}) into groups of at "
                        "least 2 experts.")
    if not 1 <= kept <= groups or kept * (e // groups) < self.experts_per_token:
      raise ConfigError(
          f"ModelConfig.router_topk_groups ({kept}) must be in [1, router_groups={groups}] and the kept groups "
          f"({kept} x {e // groups} experts) must hold experts_per_token ({self.experts_per_token}) experts.")

  def _check_gemma(self) -> None:
    """The Gemma-4 block: the dense MLP beside the MoE and its router."""
    if self.moe_with_dense_mlp:
      if not (self.is_moe and self.router == "gemma" and self.sandwich_norms and self.first_k_dense == 0):
        raise ConfigError("ModelConfig.moe_with_dense_mlp=True (dense MLP in parallel with the MoE) needs "
                          "n_experts > 0, router='gemma', sandwich_norms=True and first_k_dense=0.")
    elif self.router == "gemma":
      raise ConfigError("ModelConfig.router='gemma' needs moe_with_dense_mlp=True.")

  def _check_layer_pattern(self) -> None:
    """Sliding and global layers (`layer_pattern` and the global_* fields, `sliding_window`)."""
    fraction = self.global_rope_fraction
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
      raise ConfigError(f"ModelConfig.global_rope_fraction must be in (0, 1], got {fraction!r}.")
    global_fields = {"global_head_dim": self.global_head_dim, "global_kv_heads": self.global_kv_heads,
                     "global_rope_theta": self.global_rope_theta}
    pattern = self.layer_pattern
    if pattern is None:
      set_fields = [name for name, value in global_fields.items() if value is not None]
      set_fields += [name for name in ("sliding_window",) if getattr(self, name) is not None]
      if self.global_k_eq_v:
        set_fields.append("global_k_eq_v")
      if self.global_rope_fraction != 1.0:
        set_fields.append("global_rope_fraction")
      if set_fields:
        raise ConfigError(f"ModelConfig.{set_fields[0]} applies to models with sliding and global layers; set "
                          "layer_pattern (one 's' or 'g' per layer) or leave it at its default.")
      return
    if (not isinstance(pattern, str) or len(pattern) != self.n_layers or set(pattern) != {"s", "g"}):
      raise ConfigError(f"ModelConfig.layer_pattern must be a string of n_layers={self.n_layers} letters 's' "
                        f"(sliding-window layer) and 'g' (global layer) with both letters present, got {pattern!r}; "
                        "use layer_pattern=None for a model whose layers are all alike.")
    if self.first_k_dense or self.attention_block_size is not None or self.rotary_dim is not None:
      raise ConfigError("ModelConfig.layer_pattern cannot be combined with first_k_dense, attention_block_size or "
                        "rotary_dim; set them to 0 / None.")
    window = self.sliding_window
    if isinstance(window, bool) or not isinstance(window, int) or window < 2:
      raise ConfigError(f"ModelConfig.sliding_window must be an integer >= 2 when layer_pattern has 's' layers, "
                        f"got {window!r}.")
    for name in ("global_head_dim", "global_kv_heads"):
      value = global_fields[name]
      if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"ModelConfig.{name} must be a positive integer when layer_pattern has 'g' layers, got "
                          f"{value!r}.")
    if self.global_head_dim % 2:
      raise ConfigError(f"ModelConfig.global_head_dim must be even for rotate-half RoPE, got {self.global_head_dim}.")
    if self.n_heads % self.global_kv_heads:
      raise ConfigError(f"ModelConfig.n_heads ({self.n_heads}) must be a multiple of global_kv_heads "
                        f"({self.global_kv_heads}).")
    theta = self.global_rope_theta
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 1:
      raise ConfigError(f"ModelConfig.global_rope_theta must be a number > 1 when layer_pattern has 'g' layers, "
                        f"got {theta!r}.")

  @property
  def layer_kinds(self) -> str:
    """One letter per layer: the `layer_pattern`, or "s" for every layer of a model whose layers are alike
    (all stored in `blocks`)."""
    return self.layer_pattern if self.layer_pattern is not None else "s" * self.n_layers

  @property
  def n_global_layers(self) -> int:
    """Layers stored in `global_blocks` (the "g" letters of layer_pattern; 0 without a pattern)."""
    return self.layer_kinds.count("g")

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
