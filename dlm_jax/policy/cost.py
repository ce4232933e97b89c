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


def layer_refresh_flops(config: ModelConfig, rows: float, seq_len: int, tracked: float, start: int) -> float:
  """FLOPs of a layer-refresh call (Elastic-Cache, `dlm_jax.model.layer_refresh`; no LM head): the layers below
  `start` run `rows` queries over seq_len keys, the others all seq_len positions; every layer tests the drift of
  `tracked` tokens twice (before and now: their query projections and their attention scores over seq_len
  keys)."""
  d, n, h = config.d_model, config.n_heads, config.head_dim
  per_layer_drift = 2 * (2 * tracked * d * n * h + 2 * tracked * seq_len * n * h)
  layer = lambda r: 2 * layer_weights(config) * r + 4 * r * seq_len * n * h  # noqa: E731
  below = min(start, config.n_layers)
  return below * layer(rows) + (config.n_layers - below) * layer(seq_len) + config.n_layers * per_layer_drift


def block_sparse_flops(config: ModelConfig, seq_len: int, block_size: int, kept_blocks: int) -> float:
  """FLOPs of a block-sparse call (SparseD, `dlm_jax.model.block_sparse_attention`; no LM head): every position
  through every layer, each query block of `block_size` rows (the last one padded to a whole block) reading
  `kept_blocks` key blocks (the static count m, padded slots included)."""
  rows = -(-seq_len // block_size) * block_size
  attention = 4 * rows * kept_blocks * block_size * config.n_heads * config.head_dim
  return config.n_layers * (2 * layer_weights(config) * seq_len + attention)


def reuse_layer_flops(config: ModelConfig, rows: float, keys: float, value_rows: float = 0) -> float:
  """FLOPs of one layer of a reuse call (`dlm_jax.model.reuse_layers`, dLLM-Cache): `rows` positions
  recomputed (projections, attention over `keys` keys, feed-forward), and the value projection of
  `value_rows` further positions for the similarity (the response at an adaptive layer)."""
  d, h, kv = config.d_model, config.head_dim, config.n_kv_heads
  return 2 * layer_weights(config) * rows + 4 * rows * keys * config.n_heads * h + 2 * d * kv * h * value_rows
