"""What an SAE costs where it is used: reconstruction quality of captured activations and the cross-entropy of a
sampler's predictions with the SAE spliced in, per (layer, step bin).

Definitions (rows = activations [N, D] of one layer and step bin, e.g. the generated positions of every item at
the bin's steps):
  mse                 mean over rows and features of (x̂ − x)²
  explained_variance  1 − Σ (x̂ − x)² / Σ (x − mean_rows(x))²
  l0                  mean over rows of the number of non-zero features
  dead_fraction       the fraction of the d_sae features that are zero on every row
Cross-entropy of a sampler step (`masked_cross_entropy`): the mean over the positions still masked at that step
of −log p(target), with p the probability the "lens" capture at ln_final.hook_normalized read for the target
token (the final token of the run without the SAE), so ΔCE = CE(spliced) − CE(clean) is the extra loss of the
model's own predictions while the SAE stands in for the site.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dlm_jax.instrument import sae as sae_lib


@jax.jit
def _sums(sae: sae_lib.SAE, x: jax.Array) -> dict[str, jax.Array]:
  acts = sae_lib.encode(sae, x)
  error = sae_lib.decode(sae, acts, like=x) - x
  return {"squared_error": jnp.sum(error * error), "active": jnp.sum((acts > 0).astype(jnp.float32)),
          "fired": jnp.any(acts > 0, axis=0)}


def reconstruction_metrics(sae: sae_lib.SAE, x: np.ndarray, chunk: int = 8192) -> dict[str, float]:
  """The module's metrics of `sae` on activations x [N, D] (N >= 1), computed in chunks of rows."""
  x = np.asarray(x, np.float32)
  if x.ndim != 2 or x.shape[0] == 0 or x.shape[1] != sae.d_in:
    raise ValueError(f"reconstruction_metrics needs activations [N >= 1, {sae.d_in}], got {list(x.shape)}.")
  squared_error, active, fired = 0.0, 0.0, np.zeros((sae.d_sae,), bool)
  for start in range(0, x.shape[0], chunk):
    sums = jax.device_get(_sums(sae, jnp.asarray(x[start:start + chunk])))
    squared_error += float(sums["squared_error"])
    active += float(sums["active"])
    fired |= np.asarray(sums["fired"])
  centred = x.astype(np.float64) - x.astype(np.float64).mean(axis=0)
  total = float(np.sum(centred * centred))
  n = x.shape[0]
  return {"rows": n, "mse": squared_error / (n * x.shape[1]),
          "explained_variance": 1.0 - squared_error / total if total > 0 else float("nan"),
          "l0": active / n, "dead_fraction": float(1.0 - fired.mean())}


def step_bins(n_steps: int, bin_size: int) -> list[tuple[int, int]]:
  """[(start, stop)] covering steps 0..n_steps−1 in bins of `bin_size` (the last may be shorter)."""
  if n_steps <= 0 or bin_size <= 0:
    raise ValueError(f"step bins need n_steps > 0 and bin_size > 0, got {n_steps} and {bin_size}.")
  return [(s, min(s + bin_size, n_steps)) for s in range(0, n_steps, bin_size)]


def masked_at_steps(decode_step: np.ndarray, n_steps: int) -> np.ndarray:
  """[steps, B, G] bool: generated position g is still masked when step s runs (decoded at a step >= s, or
  never: decode_step −1), from decode_step [B, G]."""
  decode_step = np.asarray(decode_step)
  steps = np.arange(n_steps)[:, None, None]
  return (decode_step[None] >= steps) | (decode_step[None] < 0)


def masked_cross_entropy(probability: np.ndarray, decode_step: np.ndarray, prompt_length: int) -> np.ndarray:
  """[steps, B] the mean of −log p over the generated positions masked at each step (NaN where none is), from
  the lens capture's probability [steps, B, S] of the target tokens and decode_step [B, G]."""
  probability = np.asarray(probability, np.float64)[:, :, prompt_length:]
  masked = masked_at_steps(decode_step, probability.shape[0])
  loss = -np.log(np.maximum(probability, 1e-30))
  count = masked.sum(axis=2)
  with np.errstate(invalid="ignore", divide="ignore"):
    return np.where(count > 0, np.sum(np.where(masked, loss, 0.0), axis=2) / count, np.nan)
