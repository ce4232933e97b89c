"""`dlm_jax.analysis.sae_metrics` against NumPy loops: reconstruction metrics, step bins, masked cross-entropy."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from dlm_jax.analysis import sae_metrics
from dlm_jax.instrument import sae as sae_lib


def test_reconstruction_metrics_equal_numpy():
  rng = np.random.default_rng(0)
  d, f = 10, 30
  w = lambda *s: rng.normal(size=s).astype(np.float32) * 0.4  # noqa: E731
  sae = sae_lib.SAE(W_enc=jnp.asarray(w(d, f)), b_enc=jnp.asarray(w(f) - 2.0), W_dec=jnp.asarray(w(f, d)),
                    b_dec=jnp.asarray(w(d)), threshold=jnp.zeros(f), architecture="standard")
  x = rng.normal(size=(301, d)).astype(np.float32)
  got = sae_metrics.reconstruction_metrics(sae, x, chunk=64)
  p = {k: np.asarray(getattr(sae, k), np.float64) for k in ("W_enc", "b_enc", "W_dec", "b_dec")}
  acts = np.maximum((x - p["b_dec"]) @ p["W_enc"] + p["b_enc"], 0)
  error = acts @ p["W_dec"] + p["b_dec"] - x
  fired = (acts > 0).any(axis=0)
  assert 0 < fired.mean() < 1
  np.testing.assert_allclose(got["mse"], np.mean(error ** 2), rtol=1e-5)
  np.testing.assert_allclose(got["explained_variance"], 1 - np.sum(error ** 2) / np.sum((x - x.mean(0)) ** 2),
                             rtol=1e-5)
  np.testing.assert_allclose(got["l0"], np.mean(np.sum(acts > 0, axis=1)), rtol=1e-6)
  assert got["dead_fraction"] == pytest.approx(1 - fired.mean()) and got["rows"] == 301
  with pytest.raises(ValueError, match=r"needs activations \[N >= 1, 10\], got \[4, 9\]"):
    sae_metrics.reconstruction_metrics(sae, x[:4, :9])


def test_step_bins_and_masked_cross_entropy():
  assert sae_metrics.step_bins(10, 4) == [(0, 4), (4, 8), (8, 10)]
  rng = np.random.default_rng(1)
  steps, b, lp, g = 5, 3, 2, 4
  probability = rng.uniform(0.01, 1.0, size=(steps, b, lp + g))
  decode_step = np.array([[0, 1, 2, 3], [4, 4, -1, 2], [0, 0, 0, 0]])
  got = sae_metrics.masked_cross_entropy(probability, decode_step, lp)
  for s in range(steps):
    for row in range(b):
      losses = [-np.log(probability[s, row, lp + i]) for i in range(g)
                if decode_step[row, i] >= s or decode_step[row, i] < 0]
      if losses:
        assert got[s, row] == pytest.approx(np.mean(losses))
      else:
        assert np.isnan(got[s, row])
  assert np.isnan(got[1, 2]) and not np.isnan(got[0, 2])
