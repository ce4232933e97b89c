"""Token and position choice shared by the decoding families: per-row top-k positions, Dream's and
Hugging Face's logit filters, and the per-position decode step."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def select_top_k(confidence: jax.Array, k: jax.Array) -> jax.Array:
  """Per-row top-k positions as a bool mask: confidence [B, W], k [B] or scalar int -> [B, W] bool.

  Ties are routine (at temperature 0 with LLaDA's `confidence_eos_eot_inf` every position predicting EOS
  has confidence exactly 0) and go to the lowest index first (a stable descending sort); -inf entries
  are chosen only when k exceeds the number of finite ones (lowest index first among them too).
  """
  order = jnp.argsort(-confidence, axis=-1, stable=True)
  k = jnp.broadcast_to(jnp.asarray(k, jnp.int32).reshape(-1, 1), (confidence.shape[0], 1))
  chosen_sorted = jnp.arange(confidence.shape[-1])[None, :] < k
  rows = jnp.arange(confidence.shape[0])[:, None]
  return jnp.zeros(confidence.shape, bool).at[rows, order].set(chosen_sorted)


def filter_top_p(logits: jax.Array, top_p: float) -> jax.Array:
  """Dream's `top_p_logits`: drop tokens once the cumulative probability (descending) exceeds top_p,
  keeping the first token that crosses it; dropped logits become finfo(float32).min. [..., V] -> same."""
  order = jnp.argsort(-logits, axis=-1, stable=True)
  sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
  cumulative = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
  remove_sorted = cumulative > top_p
  remove_sorted = jnp.concatenate([jnp.zeros_like(remove_sorted[..., :1]), remove_sorted[..., :-1]], axis=-1)
  remove = jnp.take_along_axis(remove_sorted, jnp.argsort(order, axis=-1), axis=-1)
  return jnp.where(remove, jnp.finfo(logits.dtype).min, logits)


def filter_top_k(logits: jax.Array, top_k: int) -> jax.Array:
  """Dream's `top_k_logits`: logits below the k-th largest become finfo(float32).min. [..., V] -> same."""
  k = min(top_k, logits.shape[-1])
  kth = jax.lax.top_k(logits, k)[0][..., -1:]
  return jnp.where(logits < kth, jnp.finfo(logits.dtype).min, logits)


def update_decode_step(decode_step: jax.Array, before: jax.Array, after: jax.Array, mask_id: int,
                       step: jax.Array) -> jax.Array:
  """decode_step [B, G]: set to `step` where a generated position stops holding the mask token, back to
  -1 where it holds the mask token again. before/after: [B, G] generated tokens around the step."""
  unmasked_now = (before == mask_id) & (after != mask_id)
  decode_step = jnp.where(unmasked_now, step, decode_step)
  return jnp.where(after == mask_id, -1, decode_step).astype(jnp.int32)
