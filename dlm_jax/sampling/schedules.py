"""Step schedules of the official samplers, bit for bit.

* LLaDA / MMaDA (`reference/models.md` §2.8): within a block of `steps` steps, a row with M masked
  positions at block start unmasks ⌊M/steps⌋ + 1 tokens at the first (M mod steps) steps and ⌊M/steps⌋
  at the others.
* Dream (§3.8): timesteps are `torch.linspace(1, eps, steps + 1)` in float32 and step i unmasks
  k_i = int(M̄ · (1 − t_{i+1}/t_i)) tokens (float32 arithmetic), k = int(M̄) at the last step, where
  M̄ = (masked positions of the whole batch) / B is a float32 batch mean.

`torch.linspace` (CPU kernel of torch 2.x, and the CUDA kernel, whose compiler contracts the
multiply-add) fills the first half from the start and the second half from the end:
    step = (end − start) / (n − 1)                          (float32)
    out[i] = fma(step, i, start)            for i < n // 2  (one rounding)
    out[i] = fma(−step, n − 1 − i, end)     otherwise
`torch_linspace_f32` reproduces this exactly with rational arithmetic (verified against torch in
tests/test_schedules.py); `jnp.linspace` differs in the last ulp for many n, which changes some k_i.
"""

from __future__ import annotations

import functools
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np


def _round_to_f32(value: Fraction) -> np.float32:
  """Correctly rounded (nearest, ties to even) float32 of an exact rational."""
  guess = np.float32(float(value))
  best, best_err = guess, None
  for cand in (np.nextafter(guess, np.float32(-np.inf)), guess, np.nextafter(guess, np.float32(np.inf))):
    if not np.isfinite(cand):
      continue
    err = abs(Fraction(float(cand)) - value)
    if best_err is None or err < best_err or (err == best_err and int(cand.view(np.uint32)) % 2 == 0):
      best, best_err = cand, err
  return np.float32(best)


@functools.lru_cache(maxsize=256)
def _torch_linspace_f32_cached(start: float, end: float, n: int) -> tuple[float, ...]:
  s, e = np.float32(start), np.float32(end)
  if n == 1:
    return (float(s),)
  step = np.float32(np.float32(e - s) / np.float32(n - 1))
  fs, fe, fstep = Fraction(float(s)), Fraction(float(e)), Fraction(float(step))
  half = n // 2
  values = []
  for i in range(n):
    exact = fs + fstep * i if i < half else fe - fstep * (n - 1 - i)
    values.append(float(_round_to_f32(exact)))
  return tuple(values)


def torch_linspace_f32(start: float, end: float, n: int) -> np.ndarray:
  """`torch.linspace(start, end, n)` in float32, bit for bit: [n] float32 numpy array."""
  if n < 1:
    raise ValueError(f"linspace needs n >= 1 points, got {n}.")
  return np.asarray(_torch_linspace_f32_cached(float(start), float(end), int(n)), np.float32)


def dream_timesteps(steps: int, eps: float) -> np.ndarray:
  """Dream's `timesteps = torch.linspace(1, eps, steps + 1)`: [steps + 1] float32."""
  if steps < 1:
    raise ValueError(f"Dream needs steps >= 1, got {steps}.")
  return torch_linspace_f32(1.0, eps, steps + 1)


def dream_transfer_fractions(steps: int, eps: float) -> np.ndarray:
  """(1 − s/t) per step in float32 as torch computes it (0-dim float32 tensors): [steps] float32.

  The last entry is 1 (the official code uses k = int(M̄) there instead of the product)."""
  ts = dream_timesteps(steps, eps)
  t, s = ts[:-1], ts[1:]
  fractions = (np.float32(1.0) - (s / t).astype(np.float32)).astype(np.float32)
  fractions[-1] = np.float32(1.0)
  return fractions


def dream_transfer_count(masked_total: jax.Array, batch_size: int, fraction: jax.Array,
                         last_step: jax.Array) -> jax.Array:
  """k for one Dream step (same for every row): int(M̄ · fraction), or int(M̄) at the last step.

  masked_total: scalar int, masked positions summed over the batch; fraction: scalar float32 (from
  `dream_transfer_fractions`); last_step: scalar bool. Returns scalar int32.
  """
  mean = masked_total.astype(jnp.float32) / jnp.float32(batch_size)
  product = jnp.where(last_step, mean, mean * fraction.astype(jnp.float32))
  return jnp.floor(product).astype(jnp.int32)


def dream_transfer_counts_numpy(masked_total: int, batch_size: int, steps: int, eps: float) -> np.ndarray:
  """k_i for every step if the masked count stayed `masked_total` (host-side, for inspection): [steps]."""
  mean = np.float32(np.float32(masked_total) / np.float32(batch_size))
  fractions = dream_transfer_fractions(steps, eps)
  counts = np.floor((mean * fractions).astype(np.float32)).astype(np.int32)
  counts[-1] = int(np.floor(mean))
  return counts


def llada_transfer_counts(mask_counts: jax.Array, steps: int) -> jax.Array:
  """LLaDA's `get_num_transfer_tokens`: mask_counts [B] int -> [B, steps] int32.

  Row b transfers ⌊M_b/steps⌋ + 1 tokens at steps s < M_b mod steps and ⌊M_b/steps⌋ after.
  """
  mask_counts = jnp.asarray(mask_counts).astype(jnp.int32)
  base = mask_counts // steps
  remainder = mask_counts % steps
  index = jnp.arange(steps, dtype=jnp.int32)
  return base[:, None] + (index[None, :] < remainder[:, None]).astype(jnp.int32)
