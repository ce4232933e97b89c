"""Dream sampler: token-identical to a NumPy/torch re-implementation of `diffusion_generate` at temperature 0
(models.md §3.5–3.8), exact per-step counts, padding with cumsum positions, loops, seeds, retracing."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dlm_jax import model
from dlm_jax.model.attention import MASK_VALUE, AttentionBias
from dlm_jax.config import preset
from dlm_jax.sampling import dream, schedules
from dlm_jax.sampling.driver import TRACE_COUNTS
from dlm_jax.instrument.stats import StatsSpec
from dlm_jax.model import CallInstruments, Compute

jax.config.update("jax_default_matmul_precision", "highest")

CONFIG = preset("tiny-dream")
MASK, PAD = CONFIG.mask_token_id, CONFIG.pad_token_id
F32_MIN = float(np.finfo(np.float32).min)


@functools.lru_cache(maxsize=None)
def params():
  return model.init_params(CONFIG, jax.random.key(2))


def prompts(batch=2, length=6, seed=0):
  return np.random.default_rng(seed).integers(3, 200, size=(batch, length)).astype(np.int32)


@functools.partial(jax.jit, static_argnames=("config",))
def _reference_logits(params, tokens, positions, pairwise_bias, *, config):
  return model.forward(params, tokens, config=config, positions=positions,
                       instruments=CallInstruments(bias=AttentionBias(pairwise=pairwise_bias)),
                       compute=Compute(attention_impl="dense")).logits


def _softmax(x):
  e = np.exp(x - np.max(x, axis=-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def _sample_tokens(logits, top_p, top_k, margin, neg_entropy):
  """sample_tokens at temperature 0 (models.md §3.8b), rows of logits [n, V]."""
  logits = logits.copy()
  if top_p is not None and top_p < 1:
    order = np.argsort(-logits, axis=-1, kind="stable")
    cumulative = np.cumsum(_softmax(np.take_along_axis(logits, order, -1)), axis=-1)
    remove_sorted = cumulative > top_p
    remove_sorted[..., 1:] = remove_sorted[..., :-1].copy()
    remove_sorted[..., 0] = False
    remove = np.zeros_like(remove_sorted)
    np.put_along_axis(remove, order, remove_sorted, -1)
    logits[remove] = F32_MIN
  if top_k is not None:
    kth = np.sort(logits, axis=-1)[..., -top_k][..., None]
    logits[logits < kth] = F32_MIN
  probs = _softmax(logits)
  confidence, x0 = probs.max(-1), probs.argmax(-1)
  if margin:
    top = np.sort(probs, axis=-1)
    confidence = top[:, -1] - top[:, -2]
  if neg_entropy:
    confidence = np.sum(probs * np.log(probs + 1e-10), axis=-1)
  return confidence, x0


def reference_diffusion_generate(params, prompt, *, gen_length, steps, eps=1e-3, alg="maskgit_plus", top_p=None,
                                 top_k=None, prompt_mask=None):
  """diffusion_generate at temperature 0, alg != origin, written from models.md §3.5–3.8."""
  b, lp = prompt.shape
  x = np.concatenate([prompt, np.full((b, gen_length), MASK)], axis=1).astype(np.int64)
  positions = pair_bias = None
  if prompt_mask is not None and np.any(prompt_mask == 0):
    valid = np.concatenate([prompt_mask, np.ones((b, gen_length), prompt_mask.dtype)], axis=1)
    positions = np.cumsum(valid, axis=-1) - 1
    positions[valid == 0] = 1
    allowed = valid[:, None, :, None].astype(bool) & valid[:, None, None, :].astype(bool)
    pair_bias = np.where(allowed, 0.0, MASK_VALUE).astype(np.float32)
    positions = positions.astype(np.int32)
  timesteps = torch.linspace(1, eps, steps + 1)
  decode_step = np.full((b, gen_length), -1)
  for i in range(steps):
    mask_index = x == MASK
    logits = np.asarray(_reference_logits(params, jnp.asarray(x, jnp.int32), positions, pair_bias, config=CONFIG),
                        np.float64)
    logits = np.concatenate([logits[:, :1], logits[:, :-1]], axis=1)
    t, s = timesteps[i], timesteps[i + 1]
    confidence, x0 = _sample_tokens(logits[mask_index], top_p, top_k, alg == "topk_margin", alg == "entropy")
    num_mask_token = torch.from_numpy(mask_index).sum() / mask_index.shape[0]
    k = int(num_mask_token * (1 - s / t)) if i < steps - 1 else int(num_mask_token)
    full_confidence = np.full(x.shape, -np.inf)
    full_confidence[mask_index] = confidence
    before = x.copy()
    if k > 0:
      x_ = np.full(x.shape, MASK)
      x_[mask_index] = x0
      for row in range(b):
        chosen = np.argsort(-full_confidence[row], kind="stable")[:k]
        x[row, chosen] = x_[row, chosen]
    decode_step[(before[:, lp:] == MASK) & (x[:, lp:] != MASK)] = i
  return x, decode_step


CASES = {
    "maskgit_plus": dict(gen_length=10, steps=6, alg="maskgit_plus"),
    "topk_margin": dict(gen_length=10, steps=4, alg="topk_margin"),
    "entropy": dict(gen_length=12, steps=12, alg="entropy"),
    "entropy_top_p_top_k": dict(gen_length=8, steps=5, alg="entropy", top_p=0.9, top_k=40),
    "maskgit_top_p": dict(gen_length=8, steps=4, alg="maskgit_plus", top_p=0.5),
    "more_steps_than_tokens": dict(gen_length=6, steps=9, alg="maskgit_plus", eps=0.05),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_reference_at_temperature_zero(name):
  case = CASES[name]
  trace = dream.diffusion_generate(params(), prompts(), config=CONFIG, options=dream.DreamOptions(**case))
  tokens, decode_step = reference_diffusion_generate(params(), prompts(), **case)
  np.testing.assert_array_equal(np.asarray(trace.tokens), tokens)
  np.testing.assert_array_equal(np.asarray(trace.decode_step), decode_step)
  assert int(trace.nfe) == case["steps"]


def test_padded_batch_matches_reference_and_prompt_alone():
  rng = np.random.default_rng(4)
  short, long = rng.integers(3, 200, size=4), rng.integers(3, 200, size=7)
  batch = np.full((2, 7), PAD, np.int32)
  batch[0, 3:], batch[1] = short, long
  mask = (np.arange(7)[None, :] >= np.array([[3], [0]])).astype(np.int32)
  options = dream.DreamOptions(gen_length=8, steps=5, alg="entropy")
  together = dream.diffusion_generate(params(), batch, config=CONFIG, options=options, prompt_mask=mask)
  tokens, decode_step = reference_diffusion_generate(params(), batch, gen_length=8, steps=5, alg="entropy",
                                                     prompt_mask=mask)
  np.testing.assert_array_equal(np.asarray(together.tokens), tokens)
  np.testing.assert_array_equal(np.asarray(together.decode_step), decode_step)
  alone = dream.diffusion_generate(params(), short[None], config=CONFIG, options=options)
  np.testing.assert_array_equal(np.asarray(together.generated)[0], np.asarray(alone.generated)[0])
  np.testing.assert_array_equal(np.asarray(together.decode_step)[0], np.asarray(alone.decode_step)[0])


@pytest.mark.parametrize("steps,gen_length", [(16, 16), (7, 20), (24, 8)])
def test_step_counts_are_exact(steps, gen_length):
  options = dream.DreamOptions(gen_length=gen_length, steps=steps, alg="topk_margin", temperature=0.7, alg_temp=0.5)
  trace = dream.diffusion_generate(params(), prompts(), config=CONFIG, options=options, key=jax.random.key(1))
  counts = np.stack([np.bincount(row, minlength=steps) for row in np.asarray(trace.decode_step)])
  remaining, expected = gen_length, []
  for i, fraction in enumerate(schedules.dream_transfer_fractions(steps, 1e-3)):
    k = int(np.float32(remaining) * fraction) if i < steps - 1 else remaining
    expected.append(k)
    remaining -= k
  np.testing.assert_array_equal(counts, [expected, expected])
  assert np.all(np.asarray(trace.tokens) != MASK)


def test_origin_reveals_everything_and_is_seeded():
  options = dream.DreamOptions(gen_length=12, steps=6, alg="origin", temperature=0.5, top_p=0.95)
  run = lambda seed: dream.diffusion_generate(params(), prompts(), config=CONFIG, options=options,
                                              key=jax.random.key(seed))
  first, again, other = run(0), run(0), run(1)
  np.testing.assert_array_equal(np.asarray(first.tokens), np.asarray(again.tokens))
  np.testing.assert_array_equal(np.asarray(first.decode_step), np.asarray(again.decode_step))
  assert not np.array_equal(np.asarray(first.tokens), np.asarray(other.tokens))
  assert np.all(np.asarray(first.tokens) != MASK) and np.all(np.asarray(first.decode_step) >= 0)


def test_compiled_loop_equals_python_loop():
  options = dream.DreamOptions(gen_length=8, steps=4, alg="entropy", temperature=0.9, top_k=30, alg_temp=0.3)
  kw = dict(config=CONFIG, options=options, key=jax.random.key(4), sink_top_k=2,
            stats_spec=StatsSpec(incoming_attention=True, per_head=False))
  scan = dream.diffusion_generate(params(), prompts(), **kw)
  python = dream.diffusion_generate(params(), prompts(), loop="python", **kw)
  np.testing.assert_array_equal(np.asarray(scan.tokens), np.asarray(python.tokens))
  np.testing.assert_array_equal(np.asarray(scan.decode_step), np.asarray(python.decode_step))
  np.testing.assert_allclose(np.asarray(scan.stats["incoming_attention"]),
                             np.asarray(python.stats["incoming_attention"]), atol=1e-5)
  np.testing.assert_array_equal(np.asarray(scan.top_sinks), np.asarray(python.top_sinks))
  assert scan.stats["incoming_attention"].shape == (4, CONFIG.n_layers, 2, 14)


def test_no_retrace_for_new_prompt_of_same_length():
  options = dream.DreamOptions(gen_length=6, steps=3, alg="maskgit_plus")
  dream.diffusion_generate(params(), prompts(seed=1), config=CONFIG, options=options)
  before = TRACE_COUNTS["dream"]
  dream.diffusion_generate(params(), prompts(seed=2), config=CONFIG, options=options)
  assert TRACE_COUNTS["dream"] == before


def test_shift_uses_previous_position():
  """The prediction for the first generated position comes from the last prompt position's output."""
  prompt = prompts(1, 5)
  options = dream.DreamOptions(gen_length=4, steps=4, alg="maskgit_plus")
  trace = dream.diffusion_generate(params(), prompt, config=CONFIG, options=options)
  tokens = np.asarray(trace.tokens)
  decode_step = np.asarray(trace.decode_step)[0]
  first = int(np.argmax(decode_step == decode_step.min()))  # decoded while the canvas was all masks
  canvas = np.concatenate([prompt, np.full((1, 4), MASK)], axis=1)
  logits = np.asarray(model.forward(params(), jnp.asarray(canvas), config=CONFIG).logits)
  assert tokens[0, 5 + first] == np.argmax(logits[0, 5 + first - 1])


def test_errors():
  with pytest.raises(ValueError, match="alg"):
    dream.DreamOptions(alg="nope")
  with pytest.raises(ValueError, match="logit_shift"):
    dream.diffusion_generate(params(), prompts(), config=preset("tiny-llada"),
                             options=dream.DreamOptions(gen_length=2, steps=2))
