"""The named activation sites of the one Transformer, in TransformerLens's vocabulary.

A site is where `dlm_jax.instrument.hooks` may read (capture) or change (edit) an activation inside the
forward pass. Per-layer sites are named `blocks.{l}.{kind}`; the model-level ones have no layer. Values
at a site are [B, T, F...] for the call's T queries (F below); the sampler's captures place them in sequence
coordinates (`hooks`).

  hook_embed                  [B, T, D] the token embeddings (times √D with `embed_scale`), before
                              DiffusionGemma's self-conditioning
  blocks.{l}.hook_resid_pre   [B, T, D] the residual stream entering block l
  blocks.{l}.attn.hook_q      [B, T, N, H] queries after the projection and QK norm, before RoPE
  blocks.{l}.attn.hook_k      [B, T, K, H] keys, likewise (the keys written to a KV cache follow edits)
  blocks.{l}.attn.hook_v      [B, T, K, H] values after the projection (and `v_norm`)
  blocks.{l}.attn.hook_z      [B, T, N, H] each head's attention output, before the output projection
  blocks.{l}.attn.hook_pattern [B, P, N, S] attention probabilities of P chosen queries (capture only)
  blocks.{l}.hook_attn_out    [B, T, D] what attention adds to the residual stream (after the
                              post-attention norm of a sandwich-norm model)
  blocks.{l}.hook_resid_mid   [B, T, D] the residual stream between attention and feed-forward
  blocks.{l}.mlp.hook_post    [B, T, F] the dense MLP's hidden activation act(gate)·up (dense layers, and
                              DiffusionGemma's dense MLP beside its MoE)
  blocks.{l}.mlp.hook_router_logits [B, T, E] the MoE router's float32 logits (MoE layers)
  blocks.{l}.hook_mlp_out     [B, T, D] what the feed-forward adds to the residual stream
  blocks.{l}.hook_resid_post  [B, T, D] the block's output (after `layer_scalar`)
  ln_final.hook_normalized    [B, W, D] the final-normed hidden states of the logits window

A `layer_pattern` model's global layers have their own head width and kv heads (`global_head_dim`,
`global_kv_heads`), so per-head sites have per-layer shapes there.
"""

from __future__ import annotations

from dlm_jax.config import ModelConfig

LAYER_SITES: tuple[str, ...] = ("hook_resid_pre", "attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_z",
                                "attn.hook_pattern", "hook_attn_out", "hook_resid_mid", "mlp.hook_post",
                                "mlp.hook_router_logits", "hook_mlp_out", "hook_resid_post")
MODEL_SITES: tuple[str, ...] = ("hook_embed", "ln_final.hook_normalized")
HEAD_SITES: tuple[str, ...] = ("attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_z")
"""Sites with a head axis (the axis before the feature axis); edits there may choose heads."""


def parse(name: str) -> tuple[str, int | None]:
  """"blocks.3.hook_resid_pre" -> ("hook_resid_pre", 3); "hook_resid_pre" -> ("hook_resid_pre", None);
  "hook_embed" -> ("hook_embed", None). Raises ValueError naming the site and the known kinds."""
  if not isinstance(name, str):
    raise ValueError(f"a site name must be a string, got {name!r}.")
  kind, layer = name, None
  if name.startswith("blocks."):
    head, _, kind = name[len("blocks."):].partition(".")
    if not head.isdigit() or kind not in LAYER_SITES:
      raise ValueError(f"unknown site {name!r}: per-layer sites are blocks.{{l}}.<kind> with <kind> one of "
                       f"{', '.join(LAYER_SITES)}.")
    layer = int(head)
  if kind not in LAYER_SITES and kind not in MODEL_SITES:
    raise ValueError(f"unknown site {name!r}; the sites are {', '.join(MODEL_SITES)} and blocks.{{l}}.<kind> "
                     f"with <kind> one of {', '.join(LAYER_SITES)}.")
  return kind, layer


def full_name(kind: str, layer: int | None) -> str:
  """The TransformerLens-style name of a site: blocks.{layer}.{kind}, or kind for a model-level site."""
  return kind if layer is None else f"blocks.{layer}.{kind}"


def layer_kind(config: ModelConfig, layer: int) -> str:
  """"s" or "g": the attention kind of `layer` ("s" for every layer of a model whose layers are alike)."""
  return "s" if config.layer_pattern is None else config.layer_kinds[layer]


def _is_moe_layer(config: ModelConfig, layer: int) -> bool:
  return config.is_moe and layer >= config.first_k_dense


def unavailable(config: ModelConfig, kind: str, layer: int | None) -> str | None:
  """Why site `kind` at `layer` does not exist in this model (one line), or None when it does."""
  name = full_name(kind, layer)
  if kind in MODEL_SITES:
    return None if layer is None else f"{kind} is a model-level site; it has no layer (got {name})."
  if layer is None:
    return f"{kind} is a per-layer site; name its layers."
  if not 0 <= layer < config.n_layers:
    return f"{name}: {config.name} has layers 0..{config.n_layers - 1}."
  if kind == "mlp.hook_post" and _is_moe_layer(config, layer) and not config.moe_with_dense_mlp:
    return (f"{name}: layer {layer} is a mixture-of-experts layer (no single MLP hidden); capture "
            "mlp.hook_router_logits or hook_mlp_out there.")
  if kind == "mlp.hook_router_logits" and not _is_moe_layer(config, layer):
    return f"{name}: layer {layer} of {config.name} is a dense layer (no router)."
  return None


def feature_shape(config: ModelConfig, kind: str, layer: int | None) -> tuple[int, ...]:
  """The trailing shape F of the site's [B, T, F...] values (hook_pattern: (N, S) is call-dependent, so
  this returns (N,))."""
  c = config
  if kind in ("attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_z", "attn.hook_pattern"):
    global_layer = layer is not None and layer_kind(c, layer) == "g"
    head_dim = c.global_head_dim if global_layer else c.head_dim
    kv_heads = c.global_kv_heads if global_layer else c.n_kv_heads
    if kind == "attn.hook_pattern":
      return (c.n_heads,)
    return (kv_heads if kind in ("attn.hook_k", "attn.hook_v") else c.n_heads, head_dim)
  if kind == "mlp.hook_post":
    return (c.mlp_hidden,)
  if kind == "mlp.hook_router_logits":
    return (c.n_experts,)
  return (c.d_model,)
