"""The denoising clock of Subliminal Clocks (`reference/field_2026_12.md` §1.3) as steering vectors, and the
per-step confidence and entropy a steering sweep reads.

The clock direction at step bin k is μ[t̂] − μ[k]: μ[k] the mean residual stream over the still-masked
positions during the steps of bin k, pooled over prompts (each step weighted by its masked positions), t̂ the
target bin. Adding α·(μ[t̂] − μ[bin(t)]) at step t moves a masked position's mean to the target bin's when
α = 1 (`dlm_jax.instrument.step_schedule`: one vector per step bin, the bins as a per-step table).

Shapes: n the run's steps (model calls), B rows, S sequence positions (prompt Lp, then G generated), D model
width, V vocabulary.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dlm_jax.config import ModelConfig
from dlm_jax.model import lm_head


def step_bins(n_steps: int, n_bins: int) -> np.ndarray:
  """[n_steps] int32: step t's bin ⌊t · n_bins / n_steps⌋ (equal spans of consecutive steps)."""
  if not 0 < n_bins <= n_steps:
    raise ValueError(f"step bins: need 1 <= n_bins <= n_steps = {n_steps}, got n_bins = {n_bins}.")
  return (np.arange(n_steps) * n_bins // n_steps).astype(np.int32)


def masked_at_steps(decode_step: np.ndarray, n_steps: int, prompt_length: int) -> np.ndarray:
  """[n, B, S] bool: the generated positions still masked when step t's model call ran (decoded at step t or
  later, or never), from `Trace.decode_step` [B, G]; prompt positions are never masked."""
  decode_step = np.asarray(decode_step)
  t = np.arange(n_steps)[:, None, None]
  masked = (decode_step[None] >= t) | (decode_step[None] < 0)
  prompt = np.zeros((n_steps, decode_step.shape[0], prompt_length), bool)
  return np.concatenate([prompt, masked], axis=2)


def bin_means(step_means: np.ndarray, counts: np.ndarray, bins: np.ndarray, n_bins: int) -> np.ndarray:
  """[n_bins, D] float64: the mean over masked positions per step bin, from per-step, per-row means
  step_means [n, B, D] over counts [n, B] masked positions (pooled: Σ count·mean / Σ count); raises when a bin
  has no masked position."""
  step_means, counts = np.asarray(step_means, np.float64), np.asarray(counts, np.float64)
  out = np.zeros((n_bins, step_means.shape[-1]))
  for k in range(n_bins):
    in_bin = bins == k
    total = counts[in_bin].sum()
    if total == 0:
      raise ValueError(f"step bin {k} (steps {np.flatnonzero(in_bin).tolist()}) has no masked position; use fewer "
                       "bins.")
    out[k] = np.einsum("nb,nbd->d", counts[in_bin], step_means[in_bin]) / total
  return out


def clock_vectors(means: np.ndarray, target: int) -> np.ndarray:
  """[n_bins, D]: μ[target] − μ[k] for every bin k (zero at the target bin)."""
  return np.asarray(means[target][None] - means, np.float32)


@functools.partial(jax.jit, static_argnames=("config",))
def _confidence_entropy(params, hidden, read, config: ModelConfig):
  logits = lm_head(params, hidden, config=config)
  log_p = jax.nn.log_softmax(logits, axis=-1)
  confidence = jnp.exp(jnp.max(log_p, axis=-1))
  entropy = -jnp.sum(jnp.exp(log_p) * log_p, axis=-1)
  count = jnp.sum(read, axis=-1)
  mean = lambda x: jnp.sum(jnp.where(read, x, 0.0), axis=-1) / jnp.maximum(count, 1)  # noqa: E731
  return mean(confidence), mean(entropy), count


def step_confidence_entropy(params, config: ModelConfig, hidden: np.ndarray, masked: np.ndarray
                            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Per step and row, over the masked positions whose prediction the step computed: the mean confidence
  (largest probability) and entropy (nats) of the model's prediction, and the count of those positions
  ([n, B] each; mean 0 where the count is 0).

  hidden: [n, B, S, D] the final-normed hidden states each step computed (`ln_final.hook_normalized`
  captured at every step, positions="all"; zeros where a step computed none); masked: [n, B, S]
  (`masked_at_steps`). A position p is predicted at p − `config.logit_shift`."""
  hidden = np.asarray(hidden)
  shift = config.logit_shift
  predicted = np.zeros_like(masked)
  predicted[..., :masked.shape[-1] - shift] = masked[..., shift:]  # read at p − shift for masked p
  read = predicted & np.any(hidden != 0, axis=-1)
  outs = [_confidence_entropy(params, jnp.asarray(hidden[t]), jnp.asarray(read[t]), config)
          for t in range(hidden.shape[0])]
  return tuple(np.stack([np.asarray(o[i]) for o in outs]) for i in range(3))
