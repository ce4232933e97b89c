"""SAEs inside the compiled LLaDA sampler (`dlm_jax.instrument.sae_hooks`): the "sae" capture reduction, the
splice and feature edits, per row and per step window, against NumPy on the same run's captures (≤ 1e-5).

One compiled program: the captures read each layer's hook_resid_mid and hook_mlp_out (their sum is the layer's
output before any edit at hook_resid_post) and hook_resid_post after the edits; layer 0 is spliced by a TopK
SAE, layer 1 gets JumpReLU feature edits (clamp and add), each row with its own step window."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlm_jax.config import preset
from dlm_jax.instrument import sae as sae_lib
from dlm_jax.instrument.hook_call import CaptureValues, hook_values
from dlm_jax.instrument.hook_spec import Capture, Edit, Hooks
from dlm_jax.model import init_params
from dlm_jax.sampling import LLaDAOptions, llada
from dlm_jax.sampling.run_setup import RunSetup

CONFIG = preset("tiny-llada")
D, F = CONFIG.d_model, 48
STEPS = 4
OPTIONS = LLaDAOptions(gen_length=8, steps=STEPS, block_length=8)
HOOKS = Hooks(
    captures=(Capture("hook_resid_mid"), Capture("hook_mlp_out"), Capture("hook_resid_post"),
              Capture("blocks.0.hook_resid_mid", reduce="sae", label="features"),
              Capture("blocks.0.hook_resid_mid", reduce="sae", k=3, label="top")),
    edits=(Edit("blocks.0.hook_resid_post", "sae_splice"), Edit("blocks.1.hook_resid_post", "sae_features")))
WINDOWS = {0: np.array([[1, 3], [0, STEPS]]), 1: np.array([[0, STEPS], [2, STEPS]])}


def _random_sae(architecture, seed, k=0):
  rng = np.random.default_rng(seed)
  w = lambda *shape: jnp.asarray(rng.normal(size=shape).astype(np.float32) * 0.3)  # noqa: E731
  return sae_lib.SAE(W_enc=w(D, F), b_enc=w(F), W_dec=w(F, D), b_dec=w(D),
                     threshold=jnp.asarray(np.abs(rng.normal(size=F)).astype(np.float32) * 0.3),
                     architecture=architecture, k=k)


TOPK, JUMP = _random_sae("topk", 1, k=4), _random_sae("jumprelu", 2)
CLAMP_MASK = np.zeros((2, F), bool)
CLAMP_MASK[0, [3, 7]] = True
CLAMP_VALUE = np.zeros((2, F), np.float32)
CLAMP_VALUE[0, [3, 7]] = [2.5, 0.0]
ADD = np.zeros((2, F), np.float32)
ADD[1, 11] = 4.0


def _np_encode(sae, x):
  p = {k: np.asarray(getattr(sae, k), np.float64) for k in ("W_enc", "b_enc", "W_dec", "b_dec", "threshold")}
  pre = (x - p["b_dec"]) @ p["W_enc"] + p["b_enc"]
  if sae.architecture == "jumprelu":
    return np.maximum(pre, 0) * (pre > p["threshold"])
  keep = np.argsort(-pre, axis=-1)[..., :sae.k]
  out = np.zeros_like(pre)
  np.put_along_axis(out, keep, np.maximum(np.take_along_axis(pre, keep, -1), 0), -1)
  return out


def _np_decode(sae, acts):
  return acts @ np.asarray(sae.W_dec, np.float64) + np.asarray(sae.b_dec, np.float64)


@pytest.fixture(scope="module")
def run():
  params = init_params(CONFIG, jax.random.key(4))
  prompt = np.asarray(jax.random.randint(jax.random.key(5), (2, 5), 3, 200))
  seq = prompt.shape[1] + OPTIONS.gen_length
  values = hook_values(HOOKS, CONFIG, 2, seq, captures={3: CaptureValues(sae=JUMP), 4: CaptureValues(sae=JUMP)},
                       edits={0: dict(sae=TOPK, window=WINDOWS[0]),
                              1: dict(sae=JUMP, window=WINDOWS[1], feature_mask=CLAMP_MASK,
                                      feature_value=CLAMP_VALUE, feature_add=ADD)})
  trace = llada.generate(params, jnp.asarray(prompt), config=CONFIG, options=OPTIONS,
                         setup=RunSetup(hooks=HOOKS, hook_values=values))
  return {k: np.asarray(v, np.float64) if not hasattr(v, "indices") else v for k, v in trace.captures.items()}


def _in_window(edit, step):
  return (WINDOWS[edit][:, 0] <= step) & (step < WINDOWS[edit][:, 1])


def test_sae_capture_equals_numpy_features(run):
  expected = _np_encode(JUMP, run["blocks.0.hook_resid_mid"])
  assert (expected > 0).mean() > 0.05
  np.testing.assert_allclose(run["features.0"], expected, atol=1e-5, rtol=0)
  top = run["top.0"]
  np.testing.assert_allclose(np.asarray(top.values), -np.sort(-expected, axis=-1)[..., :3], atol=1e-5, rtol=0)
  picked = np.take_along_axis(expected, np.asarray(top.indices), -1)
  np.testing.assert_allclose(picked, np.asarray(top.values), atol=1e-5, rtol=0)


def test_splice_replaces_the_site_by_the_reconstruction_in_its_window(run):
  before = run["blocks.0.hook_resid_mid"] + run["blocks.0.hook_mlp_out"]
  expected = before.copy()
  for step in range(STEPS):
    rows = _in_window(0, step)
    expected[step, rows] = _np_decode(TOPK, _np_encode(TOPK, before[step, rows]))
  assert not np.allclose(expected, before, atol=1e-2)
  np.testing.assert_allclose(run["blocks.0.hook_resid_post"], expected, atol=1e-5, rtol=0)


def test_feature_edits_keep_the_error_term(run):
  before = run["blocks.1.hook_resid_mid"] + run["blocks.1.hook_mlp_out"]
  expected = before.copy()
  for step in range(STEPS):
    for row in np.flatnonzero(_in_window(1, step)):
      acts = _np_encode(JUMP, before[step, row])
      edited = np.where(CLAMP_MASK[row], CLAMP_VALUE[row], acts) + ADD[row]
      expected[step, row] = before[step, row] + _np_decode(JUMP, edited) - _np_decode(JUMP, acts)
  np.testing.assert_allclose(run["blocks.1.hook_resid_post"], expected, atol=1e-5, rtol=0)
  # adding 4 × feature 11 moves row 1 along W_dec[11] from step 2 on
  np.testing.assert_allclose(run["blocks.1.hook_resid_post"][2:, 1] - before[2:, 1],
                             np.broadcast_to(4.0 * np.asarray(JUMP.W_dec[11]), before[2:, 1].shape), atol=1e-5)


def test_wrong_width_and_missing_sae_are_one_line():
  narrow = _random_sae("topk", 3, k=2).replace(W_enc=jnp.zeros((D // 2, F)), b_dec=jnp.zeros(D // 2),
                                               W_dec=jnp.zeros((F, D // 2)))
  saes = {3: CaptureValues(sae=JUMP), 4: CaptureValues(sae=JUMP)}
  for kwargs, match in ((dict(captures=saes, edits={0: dict(sae=narrow), 1: dict(sae=JUMP)}),
                         r"Edit 0 \(hook_resid_post, sae_splice\): the SAE's d_in is 32, but blocks.0.hook_resid_post"),
                        (dict(captures=saes, edits={1: dict(sae=JUMP)}), r"Edit 0 .* needs sae=SAE"),
                        (dict(captures={3: CaptureValues()}, edits={0: dict(sae=TOPK), 1: dict(sae=JUMP)}),
                         r"Capture 3 .* needs CaptureValues\(sae=SAE\)")):
    with pytest.raises(ValueError, match=match) as e:
      hook_values(HOOKS, CONFIG, 2, 13, **kwargs)
    assert "\n" not in str(e.value)
  hook_values(HOOKS, CONFIG, 2, 13, captures=saes, edits={0: dict(sae=TOPK), 1: dict(sae=JUMP)})
