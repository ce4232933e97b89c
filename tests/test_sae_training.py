"""SAE training in JAX (`dlm_jax.training.sae_loop`): TopK and JumpReLU learn a planted sparse code; the
JumpReLU straight-through gradients equal a NumPy computation of the pseudo-derivatives; a stopped run resumes
to the same parameters bitwise; a run sharded over 8 devices equals the single-device run; the saved SAE
loads in sae-lens and encodes like ours."""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlm_jax.instrument import sae as sae_lib
from dlm_jax.io import saelens
from dlm_jax.runtime import sharding
from dlm_jax.training import sae_loop
from dlm_jax.training import sae_objectives as objectives

D, TRUE_FEATURES, ROWS = 16, 24, 4096


def _planted(seed=0) -> np.ndarray:
  """Rows that are sparse non-negative combinations (3 of 24) of fixed random directions, plus an offset."""
  rng = np.random.default_rng(seed)
  directions = rng.normal(size=(TRUE_FEATURES, D))
  directions /= np.linalg.norm(directions, axis=1, keepdims=True)
  codes = np.zeros((ROWS, TRUE_FEATURES))
  for row in range(ROWS):
    codes[row, rng.choice(TRUE_FEATURES, 3, replace=False)] = rng.uniform(1.0, 3.0, 3)
  return (codes @ directions + 0.5).astype(np.float32)


DATA = _planted()
TOPK = objectives.SAEObjective("topk", d_in=D, d_sae=32, k=3, dead_after=50)
JUMP = objectives.SAEObjective("jumprelu", d_in=D, d_sae=32, l0_coefficient=0.1, bandwidth=0.2,
                               init_threshold=0.2)
CONFIG = sae_loop.SAETrainConfig(steps=400, batch_size=64, lr=1e-2, warmup=10, scale_rows=1024, log_every=100,
                                 checkpoint_every=0)


def _explained_variance(sae, x):
  recon = np.asarray(sae_lib.reconstruct(sae, jnp.asarray(x)))
  return 1 - np.sum((recon - x) ** 2) / np.sum((x - x.mean(0)) ** 2)


@pytest.mark.parametrize("objective", [TOPK, JUMP], ids=["topk", "jumprelu"])
def test_learns_a_planted_sparse_code(objective):
  result = sae_loop.train_sae(objective, CONFIG, sae_loop.ArrayBatches(DATA, 64, 0), log=lambda _: None)
  assert result.step == 400 and len(result.history) == 4
  assert _explained_variance(result.sae, DATA) > 0.9
  l0 = np.mean(np.sum(np.asarray(sae_lib.encode(result.sae, jnp.asarray(DATA))) > 0, axis=1))
  assert l0 <= (3 if objective.architecture == "topk" else 10)
  if objective.architecture == "jumprelu":  # the L0 penalty at work
    assert result.history[-1]["l0"] < result.history[0]["l0"] - 1


def test_jumprelu_gradients_equal_numpy_pseudo_derivatives():
  objective = objectives.SAEObjective("jumprelu", d_in=D, d_sae=8, l0_coefficient=0.1, bandwidth=0.5,
                                      init_threshold=0.3)
  params = objectives.init_params(objective, jax.random.key(3), np.zeros(D))
  params["b_enc"] = jnp.asarray(np.random.default_rng(1).normal(size=8).astype(np.float32) * 0.3)
  x = DATA[:32]
  grads = jax.grad(lambda p: objectives.loss_fn(p, jnp.asarray(x), jnp.zeros(8, jnp.int32), objective)[0])(params)
  p = {k: np.asarray(v, np.float64) for k, v in params.items()}
  theta, eps = np.exp(p["log_threshold"]), 0.5
  pre = (x - p["b_dec"]) @ p["W_enc"] + p["b_enc"]
  acts = pre * (pre > theta)
  error = acts @ p["W_dec"] + p["b_dec"] - x
  kernel = (np.abs((pre - theta) / eps) < 0.5).astype(np.float64)
  d_acts = 2 * error @ p["W_dec"].T / len(x)
  d_theta = np.sum(d_acts * -(theta / eps) * kernel, axis=0) + 0.1 * np.sum(-(1 / eps) * kernel, axis=0) / len(x)
  assert np.abs(d_theta).max() > 1e-3
  np.testing.assert_allclose(np.asarray(grads["log_threshold"]), d_theta * theta, atol=1e-5, rtol=1e-4)
  d_pre = d_acts * (pre > theta)
  np.testing.assert_allclose(np.asarray(grads["b_enc"]), d_pre.sum(0), atol=1e-5, rtol=1e-4)


SHORT = sae_loop.SAETrainConfig(steps=30, batch_size=64, lr=1e-2, warmup=5, scale_rows=256, log_every=10,
                                checkpoint_every=10)


def test_stopped_run_resumes_to_the_same_parameters(tmp_path):
  data = sae_loop.ArrayBatches(DATA, 64, 1)
  whole = sae_loop.train_sae(TOPK, SHORT, data, log=lambda _: None)
  first = sae_loop.train_sae(TOPK, SHORT, data, run_dir=str(tmp_path / "run"), stop_after=17, log=lambda _: None)
  assert first.step == 17
  resumed = sae_loop.train_sae(TOPK, SHORT, data, run_dir=str(tmp_path / "run"), log=lambda _: None)
  assert resumed.resumed_from == 17 and resumed.step == 30
  for name in ("W_enc", "b_enc", "W_dec", "b_dec"):
    np.testing.assert_array_equal(np.asarray(getattr(resumed.sae, name)), np.asarray(getattr(whole.sae, name)))
  with pytest.raises(ValueError, match=r"other settings \(config differ\)") as e:
    sae_loop.train_sae(TOPK, dataclasses.replace(SHORT, lr=2e-2), data, run_dir=str(tmp_path / "run"))
  assert "\n" not in str(e.value)


def test_mesh_run_equals_single_device_and_loads_in_saelens(tmp_path):
  data = sae_loop.ArrayBatches(DATA, 64, 2)
  config = dataclasses.replace(SHORT, steps=12, checkpoint_every=0)
  single = sae_loop.train_sae(JUMP, config, data, log=lambda _: None)
  mesh = sharding.make_mesh(8, devices=jax.devices()[:8])
  sharded = sae_loop.train_sae(JUMP, config, data, mesh=mesh, log=lambda _: None)
  for name in ("W_enc", "b_enc", "W_dec", "b_dec", "threshold"):
    np.testing.assert_allclose(np.asarray(getattr(sharded.sae, name)), np.asarray(getattr(single.sae, name)),
                               atol=2e-5, rtol=0)
  sae_lens = pytest.importorskip("sae_lens")
  torch = pytest.importorskip("torch")
  path = saelens.save(single.sae, tmp_path / "sae", hook_name="blocks.0.hook_resid_post", model_name="planted")
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    reference = sae_lens.SAE.load_from_disk(path)
  with torch.no_grad():
    expected = reference.encode(torch.from_numpy(DATA[:64])).numpy()
  np.testing.assert_allclose(np.asarray(sae_lib.encode(single.sae, jnp.asarray(DATA[:64]))), expected, atol=1e-5,
                             rtol=0)
  assert (expected > 0).any()
