"""Analytic matmul FLOPs of a model call, for comparing what policies compute (the sweep, the benchmark).

A call runs `rows` query positions through every layer, each reading `keys` keys: per layer
2 × (projection and feed-forward weights) × rows + 4 × rows × keys × N × H (scores and the weighted sum), and the LM
head 2 × head_rows × D × V. Norms, softmax, RoPE and the router are left out (a few percent; XLA's count of a
one-layer dense program is within 5% on tiny-llada, `benchmarks/policy_bench.py`). Dense feed-forward layers only.
"""

from __future__ import annotations

from dlm_jax.config import ModelConfig


def layer_weights(config: ModelConfig) -> int:
  """Weights of one dense layer's projections and feed-forward (no norms)."""
  d, n, h, kv, f = config.d_model, config.n_heads, config.head_dim, config.n_kv_heads, config.mlp_hidden
  return d * n * h + 2 * d * kv * h + n * h * d + 3 * d * f


def trunk_flops(config: ModelConfig, rows: float, keys: float) -> float:
  """FLOPs of `rows` queries through every layer, each reading `keys` keys (no LM head)."""
  return config.n_layers * (2 * layer_weights(config) * rows + 4 * rows * keys * config.n_heads * config.head_dim)


def head_flops(config: ModelConfig, rows: float) -> float:
  """FLOPs of the LM head on `rows` positions."""
  return 2 * rows * config.d_model * config.vocab_size


def reuse_layer_flops(config: ModelConfig, rows: float, keys: float, value_rows: float = 0) -> float:
  """FLOPs of one layer of a reuse call (`dlm_jax.model.reuse_layers`, dLLM-Cache): `rows` positions
  recomputed (projections, attention over `keys` keys, feed-forward), and the value projection of
  `value_rows` further positions for the similarity (the response at an adaptive layer)."""
  d, h, kv = config.d_model, config.head_dim, config.n_kv_heads
  return 2 * layer_weights(config) * rows + 4 * rows * keys * config.n_heads * h + 2 * d * kv * h * value_rows
