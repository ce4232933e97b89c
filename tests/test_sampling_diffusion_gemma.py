"""The DiffusionGemma sampler (one compiled program on the driver) against a step-by-step NumPy reference of
transformers 5.23's `DiffusionGemmaGenerationMixin.generate`, written here, with the random draws injected:
the reference takes the same initial canvases, Gumbel noise and renoising ids (`canvas_draws`,
`step_draws`) and calls the model (checked against transformers in test_diffusion_gemma.py) once per
encoder commit and decoder step. Outputs must be token-identical, with the same number of model calls.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlm_jax import model
from dlm_jax.config import preset
from dlm_jax.sampling import diffusion_gemma as dg
from dlm_jax.instrument.stats import StatsSpec
from dlm_jax.sampling.run_setup import RunSetup
from tests.light_configs import DIFFUSIONGEMMA_SG

jax.config.update("jax_default_matmul_precision", "highest")

CONFIG = DIFFUSIONGEMMA_SG
EOS, PAD = CONFIG.eos_token_id, CONFIG.pad_token_id
_forward = jax.jit(model.forward, static_argnames=("config",))


_INIT = jax.jit(model.init_params, static_argnums=0)


def _params(eos_boost: float):
  """Random tiny weights, made peaked (argmax decisions far from ties, so the two implementations' last-bit
  differences cannot flip them) and with a contractive self-conditioning; the EOS embedding row (tied to
  the head) scaled by eos_boost so that EOS is often the argmax."""
  params = _INIT(CONFIG, jax.random.key(3))
  sc_down = params["self_conditioning"]["mlp"]["down"]
  sc_down["kernel"] = 0.1 * sc_down["kernel"]  # a contractive self-conditioning recurrence (see module docstring)
  embedding = 50.0 * params["embed"]["embedding"]  # N(0, 1) rows: peaked logits (init's 0.02 is near uniform)
  params["embed"]["embedding"] = embedding.at[EOS].multiply(eos_boost)
  return params


def _np_accept(z: np.ndarray, bound: float) -> tuple[np.ndarray, np.ndarray]:
  z = z.astype(np.float64)
  logp = z - z.max(-1, keepdims=True)
  logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
  entropy = -(np.exp(logp) * logp).sum(-1)
  accepted = np.zeros(entropy.shape, bool)
  for b in range(entropy.shape[0]):
    order = np.argsort(entropy[b], kind="stable")
    cumulative = 0.0
    for position in order:
      if cumulative <= bound:  # (cumulative including this one) − its own entropy
        accepted[b, position] = True
      cumulative += entropy[b, position]
  return accepted, entropy


def _np_pad_after_eos(row: np.ndarray) -> np.ndarray:
  out = row.copy()
  hits = np.flatnonzero(row == EOS)
  if hits.size:
    out[hits[0] + 1:] = PAD
  return out


def reference_generate(params, prompt: np.ndarray, o: dg.DiffusionGemmaOptions, key, log=None
                       ) -> tuple[np.ndarray, int, np.ndarray]:
  """HF generate's loops in NumPy (batch rows handled as HF does); returns (tokens [B, Lp + G], model calls,
  accepted [calls, B, C]: the positions each call accepted, all False at encoder calls and waiting rows)."""
  b, lp = prompt.shape
  c, n, v = o.canvas_length, o.max_denoising_steps, CONFIG.vocab_size
  tokens = np.concatenate([prompt, np.full((b, o.gen_length), PAD)], axis=1)
  cache = model.KVCache.zeros(CONFIG, b, lp + o.gen_length)
  stopped = np.zeros(b, bool)
  calls = 0
  accepted_log = []
  for k in range(o.n_canvases):
    start, stop = (0, lp) if k == 0 else (lp + (k - 1) * c, lp + k * c)
    if k > 0:
      if o.eos_stop:
        stopped |= (tokens[:, start:stop] == EOS).any(-1)
      if stopped.all():
        break
    cache = _forward(params, jnp.asarray(tokens[:, start:stop]), config=CONFIG, cache=cache, cache_offset=start).cache
    calls += 1
    accepted_log.append(np.zeros((b, c), bool))
    s = lp + k * c
    canvas = np.asarray(dg.canvas_draws(key, k, (b, c), v, False))
    argmax = canvas.copy()
    sc = np.zeros((b, c, v), np.float32)
    done = stopped.copy()
    history = np.full((max(1, o.stability_threshold), b, c), -1)
    for step in range(n):
      if done.all():
        break
      sc_in = None if step == 0 else jnp.asarray(sc)
      logits = np.asarray(_forward(params, jnp.asarray(canvas), config=CONFIG, cache=cache, cache_offset=s,
                                   decoder=model.DecoderCall(sc_in)).logits)
      calls += 1
      z = logits / (o.t_min + (o.t_max - o.t_min) * (n - step) / n)
      gumbel, renoise = (np.asarray(a) for a in dg.step_draws(key, k, jnp.int32(step), (b, c), v, False))
      sample = np.argmax(z + gumbel, -1)
      new_argmax = np.argmax(z, -1)
      accepted, entropy = _np_accept(z, o.entropy_bound)
      if log is not None:
        log.append((k, step, entropy.mean(-1), (np.argmax(z, -1) == argmax).all(-1), accepted.sum(-1)))
      new_canvas = np.where(accepted, sample, renoise)
      active = ~done
      accepted_log.append(accepted & active[:, None])
      argmax = np.where(active[:, None], new_argmax, argmax)
      canvas = np.where(active[:, None], new_canvas, canvas)
      sc = np.where(active[:, None, None], z, sc)
      if o.confidence_threshold is not None:
        stable = (history == argmax[None]).all(axis=(0, 2)) if o.stability_threshold else np.ones(b, bool)
        done = done | (active & stable & (entropy.mean(-1) < o.confidence_threshold))
      history = np.concatenate([history[1:], argmax[None]])
    block = np.stack([_np_pad_after_eos(row) for row in argmax])
    tokens[:, s:s + c] = np.where(stopped[:, None], PAD, block)
  return tokens, calls, np.stack(accepted_log)


_STEPS10 = dict(gen_length=12, canvas_length=6, max_denoising_steps=10)


@pytest.mark.parametrize("options, eos_boost", [
    # stopping on confidence alone: rows finish canvases at different steps; rows stop at EOS in different
    # canvases (the later canvas runs with stopped rows waiting)
    (dg.DiffusionGemmaOptions(**_STEPS10, stability_threshold=0, confidence_threshold=0.3), 2.0),
    # stopping on stability (a huge confidence bound); every row reaches EOS in the first canvas: the run ends
    (dg.DiffusionGemmaOptions(**_STEPS10, confidence_threshold=1e9), 4.0),
    # no adaptive stopping, a larger entropy bound, no EOS stopping: every call runs
    (dg.DiffusionGemmaOptions(gen_length=12, canvas_length=6, max_denoising_steps=3, entropy_bound=2.0,
                              confidence_threshold=None, eos_stop=False), 1.0),
])
def test_compiled_sampler_matches_the_numpy_reference(options, eos_boost):
  params = _params(eos_boost)
  prompt = np.random.default_rng(0).integers(3, CONFIG.vocab_size, (3, 5))
  key = jax.random.key(7)
  trace = dg.generate(params, prompt, config=CONFIG, options=options, key=key,
                      setup=RunSetup(stats_spec=StatsSpec(incoming_attention=True, per_head=True)))
  expected, calls, accepted = reference_generate(params, prompt, options, key)
  np.testing.assert_array_equal(np.asarray(trace.tokens), expected)
  assert int(trace.nfe) == calls
  np.testing.assert_array_equal(np.asarray(trace.accepted)[:calls], accepted)
  assert not np.asarray(trace.accepted)[calls:].any()
  assert trace.tokens.shape == (3, 5 + options.gen_length)
  _check_statistics(trace, total=5 + options.gen_length)
  most_calls = options.n_canvases * (1 + options.max_denoising_steps)
  if options.eos_stop:  # the case exercises EOS stopping and the adaptive stop
    assert (expected[:, 5:] == PAD).any() and calls < most_calls
    active = np.asarray(trace.active_rows)[:calls]
    assert (active.any(axis=1) & ~active.all(axis=1)).any()  # some decoder step ran with a row waiting
  else:
    assert calls == most_calls


def _check_statistics(trace, total: int) -> None:
  """Every call's incoming attention [L, B, N, S] is over the S cache positions: column sums that add up to
  the call's queries, zero on keys after the call's positions, and (sliding layers) zero before the last
  W−1 positions preceding them."""
  incoming = np.asarray(trace.stats["incoming_attention"])  # [steps, L, B, N, S]
  queries = np.asarray(trace.computed_queries)
  assert incoming.shape[1:] == (CONFIG.n_layers, 3, CONFIG.n_heads, total)
  sliding = [i for i, kind in enumerate(CONFIG.layer_kinds) if kind == "s"]
  for i in range(int(trace.nfe)):
    start, stop = queries[i]
    np.testing.assert_allclose(incoming[i].sum(-1), stop - start, rtol=1e-5)
    assert np.all(incoming[i, ..., stop:] == 0)
    assert np.all(incoming[i, sliding, ..., :max(0, start - CONFIG.sliding_window + 1)] == 0)
  assert not np.asarray(trace.active_rows)[0].any()  # the prompt's encoder call decodes no row


def test_options_are_validated():
  with pytest.raises(ValueError, match="multiple of canvas_length"):
    dg.DiffusionGemmaOptions(gen_length=10, canvas_length=6)
  with pytest.raises(ValueError, match="stability_threshold"):
    dg.DiffusionGemmaOptions(stability_threshold=-1)
  with pytest.raises(ValueError, match="DiffusionGemma model"):
    dg.generate({}, np.zeros((1, 3), np.int32), config=preset("tiny-llada"), options=dataclasses.replace(
        dg.DiffusionGemmaOptions(), gen_length=6, canvas_length=6))


def _statistics_run(loop: str, prompt_seed: int = 0):
  """The first parametrised case (confidence stopping, rows waiting) with statistics and an intervention."""
  options = dg.DiffusionGemmaOptions(**_STEPS10, stability_threshold=0, confidence_threshold=0.3)
  prompt = np.random.default_rng(prompt_seed).integers(3, CONFIG.vocab_size, (3, 5))
  return dg.generate(_params(2.0), prompt, config=CONFIG, options=options, key=jax.random.key(7),
                     setup=RunSetup(stats_spec=StatsSpec(incoming_attention=True, per_head=True), loop=loop))


def test_compiled_loop_equals_python_loop():
  scan, python = _statistics_run("scan"), _statistics_run("python")
  assert int(scan.nfe) == int(python.nfe)
  for name in ("tokens", "accepted", "active_rows", "computed_queries"):
    np.testing.assert_array_equal(np.asarray(getattr(scan, name)), np.asarray(getattr(python, name)), err_msg=name)
  np.testing.assert_allclose(np.asarray(scan.stats["incoming_attention"]),
                             np.asarray(python.stats["incoming_attention"]), atol=1e-5)


def test_no_retrace_for_new_prompt_of_same_length():
  from dlm_jax.sampling.driver import TRACE_COUNTS  # pylint: disable=import-outside-toplevel
  _statistics_run("scan", prompt_seed=10)
  before = TRACE_COUNTS["diffusion_gemma"]
  assert before > 0
  second, third = _statistics_run("scan", prompt_seed=11), _statistics_run("scan", prompt_seed=12)
  assert TRACE_COUNTS["diffusion_gemma"] == before
  assert not np.array_equal(np.asarray(second.tokens), np.asarray(third.tokens))  # the new prompts were decoded
