"""Sizes a model configuration may have, checked before anything is allocated.

A config.json is input like any other: `num_hidden_layers = 10**9` or a vocabulary of 10**12 must be
refused in one line, not discovered by running out of memory. Every size field has a hard ceiling far
above any released model, and the parameter count estimated from the fields (arithmetic on the config
alone, no shapes traced) must stay under `MAX_PARAMS`. The ceilings:

  n_layers <= 4096, d_model <= 131072, heads <= 4096, head widths <= 8192, feed-forward widths <= 2**20,
  vocabulary <= 2**24, experts <= 4096, sliding window / block size <= 2**22,
  estimated parameters <= 10**13 (ten trillion; the largest released models have about 10**12).
"""

from __future__ import annotations

from typing import Any

MAX_PARAMS = 10**13
LIMITS = {"n_layers": 4096, "d_model": 131072, "n_heads": 4096, "n_kv_heads": 4096, "head_dim": 8192,
          "mlp_hidden": 2**20, "vocab_size": 2**24, "n_experts": 4096, "experts_per_token": 4096,
          "expert_hidden": 2**20, "n_shared_experts": 4096, "shared_expert_hidden": 2**20, "first_k_dense": 4096,
          "router_groups": 4096, "router_topk_groups": 4096, "global_head_dim": 8192, "global_kv_heads": 4096,
          "sliding_window": 2**22, "attention_block_size": 2**22}
"""Ceiling of each integer size field of `ModelConfig`."""


def estimated_params(config: Any) -> int:
  """Parameters of `config` from its fields: embeddings and head, per layer the attention projections and
  the dense, routed and shared feed-forwards in every layer; norms and biases are left out. Within 0.5%
  of `dlm_jax.model.param_count` for the dense presets and 1.5–9% above it for the MoE presets."""
  d, n_layers = config.d_model, config.n_layers
  heads = max(config.head_dim, config.global_head_dim or 0)
  kv = max(config.n_kv_heads, config.global_kv_heads or 0)
  attention = d * heads * (2 * config.n_heads + 2 * kv)
  feed_forward = 3 * d * (config.mlp_hidden + config.n_experts * config.expert_hidden
                          + config.n_shared_experts * config.shared_expert_hidden) + d * config.n_experts
  vocabulary = config.vocab_size * d * (1 if config.tied_embeddings else 2)
  return vocabulary + n_layers * (attention + feed_forward)


def size_error(config: Any) -> str | None:
  """Why `config`'s sizes are refused (a message naming the field), or None when they are within the limits.
  Expects the field types to be checked already."""
  for field, limit in LIMITS.items():
    value = getattr(config, field)
    if isinstance(value, int) and value > limit:
      return (f"ModelConfig.{field} = {value} is above the limit {limit}; the config file is corrupted or not a "
              "model this project can hold")
  params = estimated_params(config)
  if params > MAX_PARAMS:
    return (f"ModelConfig describes about {params:.3g} parameters (n_layers={config.n_layers}, "
            f"d_model={config.d_model}, vocab_size={config.vocab_size}), above the limit {MAX_PARAMS:.0e}; the "
            "config file is corrupted")
  return None
