"""dLLM-Cache as a compute policy: its rules (`dlm_jax.policy.dllm_cache`) decide, per model call, which regions
every layer recomputes; each layer's adaptive response positions are chosen inside the forward from its own
value similarity (`dlm_jax.model.reuse_layers`, `dlm_jax.sampling.reuse_call`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dlm_jax.config import ModelConfig
from dlm_jax.instrument.stats import ForwardOutput
from dlm_jax.model.reuse_layers import ReuseCache, check_config
from dlm_jax.policy import cost, dllm_cache
from dlm_jax.policy.base import ComputePolicy, Decision, ReuseSchedule


@dataclasses.dataclass(frozen=True)
class DLLMCache(dllm_cache.DLLMCacheSettings, ComputePolicy):
  """dLLM-Cache as a policy. The call index is the driver's step (one model call per step since the generation
  began, across blocks: the official counter, reset once per generation). State [B, L, S] bool: the positions
  each layer recomputed at the last call (its `record`). Every position's residual stream runs through every
  layer, so `Trace.computed_positions` marks every position; the per-layer sets are the record."""

  def check_knobs(self) -> None:
    dllm_cache.DLLMCacheSettings.check(self)

  def check(self, config: ModelConfig | None = None, family_name: str | None = None) -> None:
    """The knobs (also checked at construction) and, for a run, the model's blocks."""
    dllm_cache.DLLMCacheSettings.check(self)
    reason = None if config is None else check_config(config)
    if reason is not None:
      raise ValueError(f"policy dllm_cache: {reason}")

  def init_state(self, config: ModelConfig, batch: int) -> jax.Array:
    return jnp.zeros((batch, config.n_layers, self.layout.seq_len), bool)

  def init_cache(self, config: ModelConfig, batch: int, seq_len: int, dtype: Any = jnp.float32) -> ReuseCache:
    return ReuseCache.zeros(config, batch, seq_len, dtype)

  def call_flops(self, config: ModelConfig, computed: np.ndarray, keys: float, record: np.ndarray) -> float:
    """Per layer its recomputed positions (record [L, S]) over all S keys, plus the value projection of the
    response at a layer that chose its positions (one that did not recompute the whole response)."""
    del computed, keys
    s, p = record.shape[-1], self.layout.gen_start
    return float(sum(cost.reuse_layer_flops(config, float(np.sum(layer)), s,
                                            value_rows=0 if np.all(layer[p:]) else s - p) for layer in record))

  def record(self, state: jax.Array) -> jax.Array:
    """[B, L, S] bool: per layer, the positions whose Q, K, attention and feed-forward outputs the call
    recomputed (the others reused them; a response position's V is replaced at every adaptive layer)."""
    return state

  def decide(self, state: jax.Array, context: Any) -> Decision:
    del state
    layout = self.layout
    prompt, gen = dllm_cache.schedule(self, jnp.asarray(context.step, jnp.int32), 1)
    return Decision(full=prompt & gen, reuse=ReuseSchedule(
        prompt=prompt, gen=gen, prompt_length=layout.gen_start,
        count=self.refresh_count(layout.seq_len - layout.gen_start), first_layer_full=self.refresh_layer0))

  def update(self, state: jax.Array, output: ForwardOutput, context: Any, decision: Decision) -> jax.Array:
    del state, context, decision
    return jnp.swapaxes(output.cache.recomputed, 0, 1)
