"""Activation hooks in one forward call (issue 24, items 1–3): every named site against an independent NumPy
forward (tests/numpy_transformer.py), the reductions against NumPy on those values, the edits against the
NumPy forward with the same edit written there, the MoE and DiffusionGemma sites, and one-line errors."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlm_jax.config import preset
from dlm_jax.instrument import sites
from dlm_jax.instrument.hook_call import (DECODED, MASKED, PROMPT, VALID, CaptureValues, HookCall, hook_values)
from dlm_jax.instrument.hook_spec import Capture, Edit, Hooks
from dlm_jax.model import CallInstruments, forward, init_params

try:
  from tests import numpy_transformer as ref
except ImportError:  # run from inside tests/
  import numpy_transformer as ref

jax.config.update("jax_default_matmul_precision", "highest")

CONFIG = preset("tiny-llada")
B, T = 2, 10
TOL = dict(atol=2e-5, rtol=2e-5)


@functools.lru_cache(maxsize=None)
def _params():
  return init_params(CONFIG, jax.random.key(3))


def _tokens():
  return np.asarray(jax.random.randint(jax.random.key(4), (B, T), 0, 200))


def _run(hooks, flags=None, step=0, **values):
  call = HookCall(hooks=hooks, values=hook_values(hooks, CONFIG, B, T, **values), flags=flags, step=step)
  return forward(_params(), jnp.asarray(_tokens()), config=CONFIG, instruments=CallInstruments(hooks=call))


def _flags():
  """Rows: positions 0..3 prompt, 4..6 masked, 7..9 decoded (row 1: position 9 is padding)."""
  flags = np.zeros((B, T), np.int32)
  flags[:, :4], flags[:, 4:7], flags[:, 7:] = VALID | PROMPT, VALID | MASKED, VALID | DECODED
  flags[1, 9] = 0
  return flags


def test_every_site_equals_the_numpy_forward():
  kinds = [k for k in sites.LAYER_SITES if k not in ("attn.hook_pattern", "mlp.hook_router_logits")]
  hooks = Hooks(captures=tuple(Capture(k) for k in kinds) + (Capture("hook_embed"), Capture("ln_final.hook_normalized"),
                Capture("attn.hook_pattern", positions=(0, 6, 9))))
  out = _run(hooks)
  logits, expected = ref.forward_sites(_params(), _tokens(), CONFIG)
  names = [sites.full_name(k, l) for k in kinds for l in range(CONFIG.n_layers)] + ["hook_embed",
                                                                                    "ln_final.hook_normalized"]
  assert set(out.captures) == set(names) | {f"blocks.{l}.attn.hook_pattern" for l in range(CONFIG.n_layers)}
  for name in names:
    np.testing.assert_allclose(np.asarray(out.captures[name]), expected[name], **TOL, err_msg=name)
  for l in range(CONFIG.n_layers):
    full = expected[f"blocks.{l}.attn.pattern_full"]  # [B, N, T, S]
    np.testing.assert_allclose(np.asarray(out.captures[f"blocks.{l}.attn.hook_pattern"]),
                               full[:, :, [0, 6, 9]].transpose(0, 2, 1, 3), **TOL)
  np.testing.assert_allclose(np.asarray(out.logits), logits, **TOL)


def test_captures_leave_the_forward_bitwise_unchanged():
  hooks = Hooks(captures=(Capture("hook_resid_mid"), Capture("attn.hook_z", layers=1, reduce="norm")))
  plain = forward(_params(), jnp.asarray(_tokens()), config=CONFIG)
  assert np.array_equal(np.asarray(_run(hooks).logits), np.asarray(plain.logits))


def test_reductions_and_position_classes():
  directions = np.asarray(jax.random.normal(jax.random.key(5), (3, CONFIG.d_model)))
  targets = _tokens()
  hooks = Hooks(captures=(
      Capture("hook_resid_post", layers=1, positions="masked", reduce="mean", label="mean"),
      Capture("hook_resid_post", layers=1, positions="decoded", reduce="norm", label="norm"),
      Capture("attn.hook_z", layers=0, positions="all", reduce="topk", k=3, label="top"),
      Capture("hook_resid_post", layers=0, positions="prompt", reduce="project", label="proj"),
      Capture("hook_resid_mid", layers=1, positions=(2, 5), reduce="lens", k=4, label="lens"),
      Capture("hook_resid_pre", layers=0, positions="all", label="all"),
      Capture("ln_final.hook_normalized", reduce="lens", k=2, label="final_lens")))
  out = _run(hooks, flags=jnp.asarray(_flags()),
             captures={3: CaptureValues(directions=jnp.asarray(directions)), 4: CaptureValues(targets=jnp.asarray(targets)),
                       6: CaptureValues(targets=jnp.asarray(targets))})
  _, s = ref.forward_sites(_params(), _tokens(), CONFIG)
  flags = _flags()
  masked, decoded, prompt = (flags & MASKED) > 0, (flags & DECODED) > 0, (flags & PROMPT) > 0
  post1 = s["blocks.1.hook_resid_post"]
  expected_mean = np.stack([post1[b][masked[b]].mean(0) for b in range(B)])
  np.testing.assert_allclose(np.asarray(out.captures["mean.1"]), expected_mean, **TOL)
  np.testing.assert_allclose(np.asarray(out.captures["norm.1"]), np.linalg.norm(post1, axis=-1) * decoded, **TOL)
  z0 = s["blocks.0.attn.hook_z"]
  top = out.captures["top.0"]
  valid = ((flags & VALID) > 0)[..., None, None]  # the pad position holds zeros
  np.testing.assert_allclose(np.asarray(top.values), -np.sort(-z0, axis=-1)[..., :3] * valid, **TOL)
  np.testing.assert_array_equal(np.asarray(top.indices), np.argsort(-z0, axis=-1, kind="stable")[..., :3] * valid)
  proj = (s["blocks.0.hook_resid_post"] @ directions.T) * prompt[..., None]
  np.testing.assert_allclose(np.asarray(out.captures["proj.0"]), proj, **TOL)
  logits = ref.readout(_params(), s["blocks.1.hook_resid_mid"][:, [2, 5]], CONFIG)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  target = targets[:, [2, 5]]
  lens = out.captures["lens.1"]
  p_target = np.take_along_axis(probs, target[..., None], -1)[..., 0]
  np.testing.assert_allclose(np.asarray(lens.probability), p_target, **TOL)
  np.testing.assert_array_equal(np.asarray(lens.rank), (logits > np.take_along_axis(logits, target[..., None], -1)).sum(-1))
  np.testing.assert_array_equal(np.asarray(lens.top_tokens), np.argsort(-probs, axis=-1, kind="stable")[..., :4])
  np.testing.assert_allclose(np.asarray(lens.top_probabilities), -np.sort(-probs, axis=-1)[..., :4], **TOL)
  np.testing.assert_allclose(np.asarray(out.captures["all.0"]), s["blocks.0.hook_resid_pre"] * valid[..., 0], **TOL)
  # at ln_final the lens is the model's own prediction (the final norm is not applied twice)
  own = jax.nn.softmax(np.asarray(out.logits, np.float64), axis=-1)
  np.testing.assert_allclose(np.asarray(out.captures["final_lens"].probability),
                             np.take_along_axis(own, targets[..., None], -1)[..., 0] * valid[..., 0, 0], **TOL)


def _edited_reference(name, function):
  return ref.forward_sites(_params(), _tokens(), CONFIG, edit=lambda n, v: function(v) if n == name else v)


def test_ablating_a_layers_attention_equals_a_forward_without_it():
  out = _run(Hooks(edits=(Edit("hook_attn_out", "zero", layers=1),)))
  logits, _ = _edited_reference("blocks.1.hook_attn_out", np.zeros_like)
  np.testing.assert_allclose(np.asarray(out.logits), logits, **TOL)
  plain, _ = ref.forward_sites(_params(), _tokens(), CONFIG)
  assert np.abs(logits - plain).max() > 1e-2  # the ablation matters


def test_edit_ops_heads_positions_and_windows():
  vector = np.asarray(jax.random.normal(jax.random.key(6), (CONFIG.d_model,)))
  flags = jnp.asarray(_flags())
  masked = (_flags() & MASKED) > 0
  # steering at still-masked positions of layer 0's output
  out = _run(Hooks(edits=(Edit("hook_resid_post", "add", layers=0, positions="masked"),)), flags=flags,
             edits={0: dict(vector=vector, coefficient=np.array([2.0, -1.0]))})
  coef = np.array([2.0, -1.0])[:, None, None]
  logits, _ = _edited_reference("blocks.0.hook_resid_post", lambda v: v + coef * vector * masked[..., None])
  np.testing.assert_allclose(np.asarray(out.logits), logits, **TOL)
  # zero one head of layer 1 for row 0 only, scale layer 0's MLP hidden, mean-ablate resid_mid at layer 1
  heads = np.array([[False, True, False, False], [False, False, False, False]])
  out = _run(Hooks(edits=(Edit("attn.hook_z", "zero", layers=1),)), edits={0: dict(heads=heads)})
  logits, _ = _edited_reference("blocks.1.attn.hook_z", lambda v: v * ~heads[:, None, :, None])
  np.testing.assert_allclose(np.asarray(out.logits), logits, **TOL)
  out = _run(Hooks(edits=(Edit("mlp.hook_post", "scale", layers=0),)), edits={0: dict(coefficient=0.5)})
  logits, _ = _edited_reference("blocks.0.mlp.hook_post", lambda v: 0.5 * v)
  np.testing.assert_allclose(np.asarray(out.logits), logits, **TOL)
  positions = np.zeros((T,), bool)
  positions[3:8] = True
  out = _run(Hooks(edits=(Edit("hook_resid_mid", "mean", layers=1),)), edits={0: dict(positions=positions)})
  logits, _ = _edited_reference(
      "blocks.1.hook_resid_mid", lambda v: np.where(positions[None, :, None], v[:, 3:8].mean(1, keepdims=True), v))
  np.testing.assert_allclose(np.asarray(out.logits), logits, **TOL)
  # a window that excludes the call's step changes nothing; one that includes it does
  hooks = Hooks(edits=(Edit("hook_resid_pre", "zero", layers=1),))
  plain = np.asarray(forward(_params(), jnp.asarray(_tokens()), config=CONFIG).logits)
  assert np.array_equal(np.asarray(_run(hooks, step=5, edits={0: dict(window=(0, 5))}).logits), plain)
  assert not np.allclose(np.asarray(_run(hooks, step=5, edits={0: dict(window=(5, 6))}).logits), plain)


def test_replace_from_values_at_listed_steps_and_layers():
  other = np.asarray(jax.random.normal(jax.random.key(7), (2, 2, B, T, CONFIG.d_model)), np.float32)
  hooks = Hooks(edits=(Edit("hook_resid_pre", "replace", source="values"),))
  out = _run(hooks, step=9, edits={0: dict(values=other, value_steps=np.array([4, 9]),
                                           layers=np.array([[True, True], [False, True]]))})
  def edit(name, v):
    if name == "blocks.0.hook_resid_pre":
      return np.concatenate([other[1, 0, :1], v[1:]])
    if name == "blocks.1.hook_resid_pre":
      return other[1, 1]
    return v
  logits, _ = ref.forward_sites(_params(), _tokens(), CONFIG, edit=edit)
  np.testing.assert_allclose(np.asarray(out.logits), logits, **TOL)
  plain = np.asarray(forward(_params(), jnp.asarray(_tokens()), config=CONFIG).logits)
  unlisted = _run(hooks, step=5, edits={0: dict(values=other, value_steps=np.array([4, 9]))})
  assert np.array_equal(np.asarray(unlisted.logits), plain)


def test_moe_router_logits_and_head_shapes_of_global_layers():
  config = preset("tiny-llada2")
  params = init_params(config, jax.random.key(0))
  tokens = jnp.asarray(_tokens()) % config.vocab_size
  hooks = Hooks(captures=(Capture("mlp.hook_router_logits"), Capture("hook_resid_mid")))
  out = forward(params, tokens, config=config,
                instruments=CallInstruments(hooks=HookCall(hooks=hooks, values=hook_values(hooks, config, B, T))))
  for layer in range(config.first_k_dense, config.n_layers):
    stack = params["blocks"]
    x = np.asarray(out.captures[f"blocks.{layer}.hook_resid_mid"], np.float64)
    w = np.asarray(stack["mlp_norm"]["weight"][layer - config.first_k_dense], np.float64)
    normed = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + config.norm_eps) * w
    expected = normed @ np.asarray(stack["mlp"]["router"]["kernel"][layer - config.first_k_dense], np.float64)
    np.testing.assert_allclose(np.asarray(out.captures[f"blocks.{layer}.mlp.hook_router_logits"]), expected, **TOL)
  assert "blocks.0.mlp.hook_router_logits" not in out.captures  # the dense first layer has no router
  gemma = preset("tiny-diffusiongemma")
  gparams = init_params(gemma, jax.random.key(0))
  hooks = Hooks(captures=(Capture("attn.hook_k"),))
  out = forward(gparams, tokens % gemma.vocab_size, config=gemma,
                instruments=CallInstruments(hooks=HookCall(hooks=hooks, values=hook_values(hooks, gemma, B, T))))
  for layer, kind in enumerate(gemma.layer_kinds):
    heads, width = ((gemma.global_kv_heads, gemma.global_head_dim) if kind == "g" else (gemma.n_kv_heads, gemma.head_dim))
    assert out.captures[f"blocks.{layer}.attn.hook_k"].shape == (B, T, heads, width)


@pytest.mark.parametrize("make, message", [
    (lambda: Capture("blocks.1.hook_nothing"), "unknown site"),
    (lambda: Capture("hook_resid_pre", layers=(0, 0)), "repeated layers"),
    (lambda: Capture("attn.hook_pattern"), "positions=(query indices"),
    (lambda: Capture("hook_resid_pre", reduce="lens"), "needs k >= 1"),
    (lambda: Capture("attn.hook_q", reduce="lens", k=2), "residual-stream site"),
    (lambda: Edit("attn.hook_pattern", "zero"), "can be captured, not edited"),
    (lambda: Edit("hook_resid_pre", "erase"), "Edit.op must be one of"),
    (lambda: Hooks(captures=(Capture("blocks.7.hook_resid_pre"),)).check(CONFIG), "has layers 0..1"),
    (lambda: Hooks(captures=(Capture("mlp.hook_router_logits", layers=0),)).check(CONFIG), "dense layer"),
    (lambda: Hooks(captures=(Capture("hook_z", layers=0),)), "unknown site"),
    (lambda: Hooks(captures=(Capture("hook_embed"), Capture("hook_embed"))).check(CONFIG), "distinct label"),
    (lambda: hook_values(Hooks(edits=(Edit("hook_resid_pre", "add"),)), CONFIG, B, T), "needs vector"),
    (lambda: hook_values(Hooks(edits=(Edit("hook_resid_pre", "add"),)), CONFIG, B, T,
                         edits={0: dict(vector=np.zeros(3))}), "vector must be [64]"),
])
def test_bad_hooks_are_refused_in_one_line(make, message):
  with pytest.raises(ValueError, match=re.escape(message)) as error:
    make()
  assert "\n" not in str(error.value)
