"""Rotary position embedding, rotate-half (NeoX / HF-Llama) convention."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rope_tables(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
  """cos and sin tables, [B, T, H] float32, for integer positions [B, T].

  inv_freq[j] = θ^(−2j/H) for j < H/2; the angle table is positions ⊗ inv_freq repeated twice along H.
  For partial RoPE pass the rotary width d_r as `head_dim` (tables [B, T, d_r], exponent over d_r).
  """
  exponents = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
  inv_freq = 1.0 / (jnp.float32(theta) ** exponents)
  angles = positions.astype(jnp.float32)[..., None] * inv_freq
  angles = jnp.concatenate([angles, angles], axis=-1)
  return jnp.cos(angles), jnp.sin(angles)


def proportional_rope_tables(positions: jax.Array, head_dim: int, theta: float, fraction: float
                             ) -> tuple[jax.Array, jax.Array]:
  """cos and sin tables [B, T, H] float32 of "proportional" RoPE (Gemma 4 global layers).

  inv_freq[j] = θ^(−2j/H) for j < int(fraction·H // 2) and 0 for the remaining pairs, so those dims are
  not rotated (cos 1, sin 0); the tables span the whole head (rotate-half pairs j, j + H/2). fraction 1
  gives `rope_tables`.
  """
  rotated = int(fraction * head_dim // 2)
  exponents = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
  inv_freq = jnp.where(jnp.arange(head_dim // 2) < rotated, 1.0 / (jnp.float32(theta) ** exponents), 0.0)
  angles = positions.astype(jnp.float32)[..., None] * inv_freq
  angles = jnp.concatenate([angles, angles], axis=-1)
  return jnp.cos(angles), jnp.sin(angles)


def _rotate_half(x: jax.Array) -> jax.Array:
  half = x.shape[-1] // 2
  return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, *, fp32: bool) -> jax.Array:
  """Rotates x [B, T, N, H] by the tables [B, T, d_r] (d_r <= H).

  fp32=True rotates in float32 and casts back (LLaDA's `rope_full_precision`); otherwise the tables are
  cast to x's dtype and the rotation happens in that dtype (HF Llama / Qwen2 / Dream). With d_r < H
  (partial RoPE, LLaDA2.x) only the leading d_r dims of each head are rotated, rotate-half inside them,
  and the remaining H − d_r dims pass through unchanged.
  """
  rotary = cos.shape[-1]
  if rotary < x.shape[-1]:
    rotated = apply_rope(x[..., :rotary], cos, sin, fp32=fp32)
    return jnp.concatenate([rotated, x[..., rotary:]], axis=-1)
  cos, sin = cos[:, :, None, :], sin[:, :, None, :]
  if fp32:
    xf = x.astype(jnp.float32)
    return (xf * cos + _rotate_half(xf) * sin).astype(x.dtype)
  return x * cos.astype(x.dtype) + _rotate_half(x) * sin.astype(x.dtype)
