"""The KV cache of cached and windowed model calls."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from dlm_jax.config import ModelConfig


@struct.dataclass
class KVCache:
  """Keys and values of every layer for cached decoding (RoPE applied).

  keys, values: [L, B, S, K, H] — every layer, in order, for a model whose layers are alike; with
  `config.layer_pattern` only the sliding ("s") layers, in order: [L_s, B, S, K, H].
  global_keys, global_values: [L_g, B, S, K_g, H_g] for the global ("g") layers of a `layer_pattern`
  model (K_g = global_kv_heads, H_g = global_head_dim), else None. Every kind keeps all S positions; the
  sliding window is applied by the attention mask, so the same cache index is the same sequence index
  in every layer.
  """

  keys: jax.Array
  values: jax.Array
  global_keys: jax.Array | None = None
  global_values: jax.Array | None = None

  @classmethod
  def zeros(cls, config: ModelConfig, batch_size: int, max_length: int, dtype: Any = jnp.float32) -> KVCache:
    shapes = cache_shapes(config, batch_size, max_length)
    arrays = [jnp.zeros(shapes[kind], dtype) for kind in ("s", "s", "g", "g") if kind in shapes]
    return cls(*arrays)


def cache_shapes(config: ModelConfig, batch: int, length: int) -> dict[str, tuple[int, ...]]:
  """{"s": [L_s, B, S, K, H], "g": [L_g, B, S, K_g, H_g] (layer_pattern models only)}."""
  kinds = config.layer_kinds
  shapes = {"s": (kinds.count("s"), batch, length, config.n_kv_heads, config.head_dim)}
  if config.layer_pattern is not None:
    shapes["g"] = (kinds.count("g"), batch, length, config.global_kv_heads, config.global_head_dim)
  return shapes
