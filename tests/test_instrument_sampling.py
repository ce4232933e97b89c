"""Activation hooks inside every decoding family and mode (issue 24, items 2–4).

For every family and mode, one run captures `hook_embed` and `ln_final.hook_normalized` at every step and is
checked against what the run must have computed, independently of the hook code:
  * placement: at each step, `hook_embed` holds E[token]·scale at exactly the queries the step computed
    (`Trace.computed_queries`, in sequence coordinates: a KV-cache call's queries at their offset) — the
    tokens of that step's canvas, rebuilt from `Trace.decode_step` (the positions decoded before the step)
    or, for DiffusionGemma, read from `Trace.canvases` — and zeros elsewhere;
  * step alignment: at temperature 0 every generated token is the argmax of the LM head applied (in NumPy)
    to the captured final hidden state at the step that decoded it (Dream and the autoregressive models:
    at the previous position, their logit shift).
Then: the step selections against the every-step capture, the Python loop and batch-invariant runs, CFG's
conditional half, and patching every layer from one run into another reproducing the first run.

The subject is the hooks in each family's loop, not the layer arrangement: block diffusion runs on tiny-llada with
block-causal attention and DiffusionGemma on its two-layer variant (`tests/light_configs`; the presets' layer
arrangements are the subject of test_instrument_forward and the parity tests). One compiled program per case,
shared by the placement and patching tests (BUILD.md, "Measuring the suite (issue 38)").
"""

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlm_jax.config import preset
from dlm_jax.instrument.hook_call import hook_values
from dlm_jax.instrument.hook_spec import Capture, Edit, Hooks, Steps
from dlm_jax.analysis.patching import patch_values
from dlm_jax.model import flatten_params, init_params
from dlm_jax.sampling.driver import capture_bytes
from dlm_jax.sampling import (AROptions, BlockDiffusionOptions, DiffusionGemmaOptions, DreamOptions, LLaDAOptions,
                              autoregressive, block_diffusion, diffusion_gemma, dream, llada)
from tests.light_configs import DIFFUSIONGEMMA_SG, LLADA_BLOCK4

jax.config.update("jax_default_matmul_precision", "highest")

LP = 5
EVERY_STEP = Hooks(captures=(Capture("hook_embed"), Capture("ln_final.hook_normalized"), Capture("hook_resid_pre")))
"""What the placement test captures; the patching test's runs reuse its compiled programs."""

LLADA, DREAM = preset("tiny-llada"), preset("tiny-dream")
CASES = {
    "llada_semi_ar": (LLADA, llada.generate, LLaDAOptions(gen_length=8, steps=4, block_length=4)),
    "llada_cfg": (LLADA, llada.generate, LLaDAOptions(gen_length=8, steps=4, block_length=4, cfg_scale=1.0)),
    "llada_threshold_dual": (LLADA, llada.generate,
                             LLaDAOptions(gen_length=8, steps=4, block_length=4, threshold=0.3, cache="dual")),
    "llada_prefix": (LLADA, llada.generate, LLaDAOptions(gen_length=8, steps=4, block_length=4, cache="prefix")),
    "dream_exact": (DREAM, dream.diffusion_generate, DreamOptions(gen_length=8, steps=4)),
    "dream_dual": (DREAM, dream.diffusion_generate,
                   DreamOptions(gen_length=8, steps=4, block_length=4, cache="dual", alg="maskgit_plus")),
    "autoregressive": (preset("tiny-llama"), autoregressive.generate, AROptions(gen_length=4)),
    "block_diffusion": (LLADA_BLOCK4, block_diffusion.generate,
                        BlockDiffusionOptions(gen_length=8, block_length=4, steps=2, threshold=None)),
    "block_diffusion_uncached": (LLADA_BLOCK4, block_diffusion.generate,
                                 BlockDiffusionOptions(gen_length=8, block_length=4, steps=2, threshold=None,
                                                       cache=False)),
    "diffusion_gemma": (DIFFUSIONGEMMA_SG, diffusion_gemma.generate,
                        DiffusionGemmaOptions(gen_length=8, canvas_length=4, max_denoising_steps=3)),
}


@functools.lru_cache(maxsize=None)
def _params(config):
  return init_params(config, jax.random.key(2))


def _prompt(config, batch=2, seed=0):
  return np.asarray(jax.random.randint(jax.random.key(seed), (batch, LP), 3, min(config.vocab_size, 200)))


def _run(case, hooks=EVERY_STEP, prompt=None, **kwargs):
  config, generate, options = CASES[case]
  prompt = _prompt(config) if prompt is None else prompt
  return generate(_params(config), jnp.asarray(prompt), config=config, options=options, hooks=hooks, **kwargs)


@functools.lru_cache(maxsize=None)
def _every_step(case):
  """The case's run on its default prompt with `EVERY_STEP` (NumPy leaves), shared by the placement and patching
  tests."""
  return _np(_run(case))


def _np(tree):
  return jax.tree.map(np.asarray, tree)


def _lm_head(config, params, hidden):
  head = params["embed"]["embedding"].T if config.tied_embeddings else params["lm_head"]["kernel"]
  logits = np.asarray(hidden, np.float64) @ np.asarray(head, np.float64)
  if config.final_logit_softcap is not None:
    logits = np.tanh(logits / config.final_logit_softcap) * config.final_logit_softcap
  return logits


def _canvas_at(trace, config, step):
  """[B, S] the canvas step `step` read: the final tokens where decoded before it, else the fill token."""
  tokens, decode_step = np.array(trace.tokens), np.asarray(trace.decode_step)
  fill = config.mask_token_id if config.mask_token_id is not None else config.pad_token_id
  gen = tokens[:, LP:]
  gen[(decode_step >= step) | (decode_step < 0)] = fill
  tokens[:, LP:] = gen
  return tokens


@pytest.mark.parametrize("case", sorted(CASES))
def test_captures_sit_at_the_computed_queries_of_each_step(case):
  config = CASES[case][0]
  params = _params(config)
  trace = _every_step(case)
  embedding = np.asarray(params["embed"]["embedding"], np.float64)
  scale = np.sqrt(config.d_model) if config.embed_scale else 1.0
  embeds, hidden = trace.captures["hook_embed"], trace.captures["ln_final.hook_normalized"]
  assert int(trace.nfe) > 1
  for step in range(int(trace.nfe)):
    start, stop = trace.computed_queries[step]
    canvas = _canvas_at(trace, config, step)
    if case == "diffusion_gemma" and trace.canvases[step].any():  # a decoder step: its noisy canvas
      canvas[:, start:stop] = trace.canvases[step]
    expected = np.zeros_like(embeds[step], np.float64)
    expected[:, start:stop] = embedding[canvas[:, start:stop]] * scale
    np.testing.assert_allclose(embeds[step], expected, atol=1e-5, rtol=1e-5, err_msg=f"step {step}")
  if case in ("diffusion_gemma", "llada_cfg"):
    return  # sampled acceptance / guided logits: the argmax check below does not apply
  shift = config.logit_shift
  checked = 0
  for b in range(trace.tokens.shape[0]):
    for g, step in enumerate(trace.decode_step[b]):
      if step < 0:
        continue
      position = LP + g
      logits = _lm_head(config, params, hidden[step, b, position - shift])
      assert int(np.argmax(logits)) == int(trace.tokens[b, position]), (case, b, g, step)
      checked += 1
  assert checked >= trace.tokens.shape[0] * 3


def test_step_selections_python_loop_and_batch_invariance():
  hooks = Hooks(captures=(
      Capture("hook_resid_post", layers=1, label="all"),
      Capture("hook_resid_post", layers=1, steps=Steps.at_steps(1, 3), label="at"),
      Capture("hook_resid_post", layers=1, steps=Steps.every(3), label="every"),
      Capture("hook_resid_post", layers=1, steps=Steps.block_starts(), label="starts"),
      Capture("hook_resid_post", layers=1, steps=Steps.decoded(), label="decoded"),
      Capture("hook_resid_post", layers=1, reduce="mean", positions="committed", label="committed")))
  # one batch-invariant run of three rows is checked against its every-step capture, the Python loop and its
  # first row run alone (one compiled program for the three comparisons)
  prompt = _prompt(LLADA, batch=3, seed=1)
  trace = _np(_run("llada_semi_ar", hooks, prompt=prompt, batch_invariant=True))
  batch = trace.tokens.shape[0]
  every = trace.captures["all.1"]
  for label, steps in (("at", [1, 3]), ("every", [0, 3]), ("starts", [0, 2])):
    np.testing.assert_array_equal(trace.capture_steps[f"{label}.1"], steps)
    np.testing.assert_array_equal(trace.captures[f"{label}.1"], every[steps])
  decoded = trace.captures["decoded.1"]
  for b in range(batch):
    for g, step in enumerate(trace.decode_step[b]):
      np.testing.assert_array_equal(decoded[b, LP + g], every[step, b, LP + g])
  # committed = decoded at the step before: the mean over them
  for step in range(1, 4):
    for b in range(batch):
      newly = LP + np.flatnonzero(trace.decode_step[b] == step - 1)
      np.testing.assert_allclose(trace.captures["committed.1"][step, b], every[step, b, newly].mean(0), atol=1e-5)
  python = _np(_run("llada_semi_ar", hooks, prompt=prompt, batch_invariant=True, loop="python"))
  for name in trace.captures:
    np.testing.assert_allclose(python.captures[name], trace.captures[name], atol=1e-5, err_msg=name)
  alone = _np(_run("llada_semi_ar", hooks, prompt=prompt[:1], batch_invariant=True))
  planned = capture_bytes(lambda: _run("llada_semi_ar", hooks, prompt=prompt, batch_invariant=True))
  assert planned == sum(leaf.nbytes for leaf in jax.tree.leaves(trace.captures))
  for name in alone.captures:
    first_row = trace.captures[name][:, :1] if name in trace.capture_steps else trace.captures[name][:1]
    np.testing.assert_array_equal(first_row, alone.captures[name], err_msg=name)


def test_cfg_captures_hold_the_conditional_half():
  trace = _np(_run("llada_cfg", Hooks(captures=(Capture("hook_embed", steps=Steps.at_steps(0)),))))
  embedding = np.asarray(_params(LLADA)["embed"]["embedding"])
  np.testing.assert_allclose(trace.captures["hook_embed"][0], embedding[_canvas_at(trace, LLADA, 0)],
                             atol=1e-6)


@pytest.mark.parametrize("case", ["llada_threshold_dual", "diffusion_gemma"])
def test_patching_every_layer_from_a_into_b_reproduces_a(case):
  config = CASES[case][0]
  layers = list(range(config.n_layers))
  prompt_a = _prompt(config)
  prompt_b = prompt_a.copy()
  prompt_b[:, 2] = (prompt_b[:, 2] + 7) % 200 + 3
  a, b = _every_step(case), _np(_run(case, EVERY_STEP, prompt_b))
  assert not np.array_equal(a.tokens[:, LP:], b.tokens[:, LP:])
  values, steps = patch_values(a, [f"blocks.{l}.hook_resid_pre" for l in layers])
  patch = Hooks(edits=(Edit("hook_resid_pre", "replace", source="values"),))
  total = a.tokens.shape[1]
  patched = _np(_run(case, patch, prompt_b, hook_values=hook_values(
      patch, config, 2, total, edits={0: dict(values=values, value_steps=steps)})))
  np.testing.assert_array_equal(patched.tokens[:, LP:], a.tokens[:, LP:])
  np.testing.assert_array_equal(patched.decode_step, a.decode_step)


def test_a_capture_keeping_no_step_is_refused():
  with pytest.raises(ValueError, match="keeps no step of this run"):
    _run("llada_semi_ar", Hooks(captures=(Capture("hook_embed", steps=Steps.at_steps(50)),)))


_MESH_DRIVER = r"""
import sys
import jax, jax.numpy as jnp, numpy as np
jax.config.update("jax_default_matmul_precision", "highest")
from dlm_jax.config import preset
from dlm_jax.instrument.hook_call import hook_values
from dlm_jax.instrument.hook_spec import Capture, Edit, Hooks
from dlm_jax.model import unflatten_params
from dlm_jax.runtime import sharding
from dlm_jax.sampling import LLaDAOptions, llada
config = preset("tiny-llada")
with np.load(sys.argv[1]) as saved:  # the parent's parameters and prompt: no initialiser compiled here
  prompt = saved["prompt"]
  params = jax.tree.map(jnp.asarray, unflatten_params({k: saved[k] for k in saved.files if k != "prompt"}))
hooks = Hooks(captures=(Capture("hook_resid_mid", layers=1, reduce="mean", positions="masked"),
                        Capture("attn.hook_z", layers=0)),
              edits=(Edit("hook_resid_post", "add", layers=0, positions="masked"),))
values = hook_values(hooks, config, 4, 13, edits={0: dict(vector=jnp.ones(config.d_model), coefficient=jnp.arange(4.0))})
options = LLaDAOptions(gen_length=8, steps=4, block_length=4)
alone = llada.generate(params, prompt, config=config, options=options, hooks=hooks, hook_values=values)
plain = llada.generate(params, prompt, config=config, options=options)
# row 0 steers with coefficient 0: a no-op, bitwise; the others steer by 1, 2, 3 and decode other tokens
assert np.array_equal(np.asarray(alone.tokens)[0], np.asarray(plain.tokens)[0])
assert not np.array_equal(np.asarray(alone.tokens)[1:], np.asarray(plain.tokens)[1:])
mesh = sharding.make_mesh(data=2, tensor=2)
sharded = sharding.put_host(params, sharding.param_shardings(config, mesh, params))
with jax.set_mesh(mesh):
  meshed = llada.generate(sharded, sharding.put_rows(prompt, mesh), config=config, options=options, hooks=hooks,
                          hook_values=values)
assert np.array_equal(np.asarray(meshed.tokens), np.asarray(alone.tokens))
for name in alone.captures:
  np.testing.assert_allclose(np.asarray(meshed.captures[name]), np.asarray(alone.captures[name]), atol=1e-5)
print("ok", sorted(alone.captures))
"""


def test_captures_and_edits_under_a_mesh(tmp_path):
  """Captures and a per-row steering edit under a data × tensor mesh of 4 CPU devices equal the unsharded run;
  steering with coefficient 0 changes nothing."""
  saved = tmp_path / "inputs.npz"
  np.savez(saved, prompt=_prompt(LLADA, batch=4), **_np(flatten_params(_params(LLADA))))
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  done = subprocess.run([sys.executable, "-c", _MESH_DRIVER, str(saved)], cwd=root, env=env, capture_output=True,
                        text=True, timeout=900, check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  assert done.stdout.startswith("ok")
