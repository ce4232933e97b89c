"""Autoregressive decoding with a KV cache: greedy equals a no-cache NumPy loop, padding, sampling, loops."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlm_jax.instrument import interventions as iv
from dlm_jax import model
from dlm_jax.config import preset
from dlm_jax.sampling import autoregressive as ar
from dlm_jax.sampling.driver import TRACE_COUNTS
from dlm_jax.instrument.stats import StatsSpec
from dlm_jax.model import Compute
from dlm_jax.sampling.run_setup import RunSetup

jax.config.update("jax_default_matmul_precision", "highest")

CONFIG = preset("tiny-qwen2")
PAD, EOS = CONFIG.pad_token_id, CONFIG.eos_token_id


@functools.lru_cache(maxsize=None)
def params():
  return model.init_params(CONFIG, jax.random.key(3))


def prompts(batch=2, length=5, seed=0):
  return np.random.default_rng(seed).integers(3, 200, size=(batch, length)).astype(np.int32)


@functools.partial(jax.jit, static_argnames=("config",))
def _full_logits(params, tokens, *, config):
  return model.forward(params, tokens, config=config, compute=Compute(attention_impl="dense")).logits


def assert_greedy(tokens, prompt_length):
  """Greedy decoding without a cache, checked by teacher forcing on the final sequence: every generated
  token is the argmax of the full (uncached, dense) causal forward at the position before it."""
  logits = np.asarray(_full_logits(params(), jnp.asarray(tokens, jnp.int32), config=CONFIG))
  np.testing.assert_array_equal(tokens[:, prompt_length:], np.argmax(logits[:, prompt_length - 1:-1], axis=-1))


def test_greedy_matches_uncached_forward():
  trace = ar.generate(params(), prompts(), config=CONFIG, options=ar.AROptions(gen_length=8))
  assert_greedy(np.asarray(trace.tokens), 5)
  np.testing.assert_array_equal(np.asarray(trace.decode_step), np.tile(np.arange(8), (2, 1)))
  assert int(trace.nfe) == 8


def test_prompt_alone_equals_left_padded_batch():
  rng = np.random.default_rng(5)
  short, long = rng.integers(3, 200, size=3), rng.integers(3, 200, size=6)
  batch = np.full((2, 6), PAD, np.int32)
  batch[0, 3:], batch[1] = short, long
  mask = (np.arange(6)[None, :] >= np.array([[3], [0]])).astype(np.int32)
  options = ar.AROptions(gen_length=6)
  together = ar.generate(params(), batch, config=CONFIG, options=options, prompt_mask=mask)
  alone = ar.generate(params(), short[None], config=CONFIG, options=options)
  np.testing.assert_array_equal(np.asarray(together.generated)[0], np.asarray(alone.generated)[0])
  assert_greedy(np.asarray(together.tokens)[1:], 6)


def test_sampling_is_seeded_and_loop_equals_python():
  options = ar.AROptions(gen_length=6, temperature=1.0, top_k=20, top_p=0.9)
  kw = dict(config=CONFIG, options=options, stats_spec=StatsSpec(incoming_attention=True), sink_top_k=2)
  first = ar.generate(params(), prompts(), key=jax.random.key(0), **kw)
  again = ar.generate(params(), prompts(), key=jax.random.key(0), loop="python", **kw)
  other = ar.generate(params(), prompts(), key=jax.random.key(1), **kw)
  np.testing.assert_array_equal(np.asarray(first.tokens), np.asarray(again.tokens))
  np.testing.assert_allclose(np.asarray(first.stats["incoming_attention"]),
                             np.asarray(again.stats["incoming_attention"]), atol=1e-5)
  np.testing.assert_array_equal(np.asarray(first.top_sinks), np.asarray(again.top_sinks))
  assert not np.array_equal(np.asarray(first.tokens), np.asarray(other.tokens))


def test_statistics_per_step():
  prompt = prompts()
  trace = ar.generate(params(), prompt, config=CONFIG, options=ar.AROptions(gen_length=4),
                      setup=RunSetup(stats_spec=StatsSpec(incoming_attention=True), sink_top_k=1))
  incoming = np.asarray(trace.stats["incoming_attention"])  # [steps, L, B, N, S]
  assert incoming.shape == (4, CONFIG.n_layers, 2, CONFIG.n_heads, 9)
  np.testing.assert_allclose(incoming.sum(-1)[0], 5.0, rtol=1e-5)  # prefill: 5 queries
  np.testing.assert_allclose(incoming.sum(-1)[1:], 1.0, rtol=1e-5)  # then one query per step
  assert np.all(incoming[2, ..., 7:] == 0)  # keys not written yet receive nothing
  # the prefill statistics equal the causal forward's column sums over the prompt
  dense = model.forward(params(), jnp.asarray(prompt), config=CONFIG, attention_impl="dense",
                        stats_spec=StatsSpec(incoming_attention=True)).incoming_attention[:, :, 0]  # Q = 1
  np.testing.assert_allclose(incoming[0, ..., :5], np.asarray(dense), atol=1e-5)
  # the last step's row: the query at position 7 over keys 0..7
  dense = model.forward(params(), jnp.asarray(np.asarray(trace.tokens)[:, :8]), config=CONFIG,
                        attention_impl="dense", stats_spec=StatsSpec(incoming_attention=True, query_groups=1),
                        query_weights=jnp.asarray(np.eye(8)[None, 7:8].repeat(2, 0), jnp.float32)).incoming_attention
  np.testing.assert_allclose(incoming[3, ..., :8], np.asarray(dense)[:, :, 0], atol=1e-5)


def test_stop_at_eos_pads_after_eos():
  head = params()["lm_head"]["kernel"]
  eos_params = dict(params())
  first = int(ar.generate(params(), prompts(), config=CONFIG, options=ar.AROptions(gen_length=5)).tokens[0, 5])
  eos_params["lm_head"] = {"kernel": head.at[:, EOS].set(head[:, first] * 1.2)}
  options = ar.AROptions(gen_length=5, stop_at_eos=True)
  trace = ar.generate(eos_params, prompts(), config=CONFIG, options=options)
  row = np.asarray(trace.generated)[0]
  assert row[0] == EOS and np.all(row[1:] == PAD)


def test_mask_previous_sinks_ar_runs_inside_the_loop():
  options = ar.AROptions(gen_length=4)
  plain = ar.generate(params(), prompts(), config=CONFIG, options=options)
  off = ar.generate(params(), prompts(), config=CONFIG, options=options,
                    setup=RunSetup(intervention=iv.MaskPreviousSinksAR(top_k=0)))
  masked = ar.generate(params(), prompts(), config=CONFIG, options=options,
                       setup=RunSetup(intervention=iv.MaskPreviousSinksAR(top_k=2),
                                      stats_spec=StatsSpec(incoming_attention=True)))
  np.testing.assert_array_equal(np.asarray(off.tokens), np.asarray(plain.tokens))
  incoming = np.asarray(masked.stats["incoming_attention"])
  assert np.sum(incoming[1:] == 0) > np.sum(np.asarray(
      ar.generate(params(), prompts(), config=CONFIG, options=options,
                  setup=RunSetup(stats_spec=StatsSpec(incoming_attention=True))).stats["incoming_attention"])[1:] == 0)


def test_no_retrace_and_errors():
  options = ar.AROptions(gen_length=3)
  ar.generate(params(), prompts(seed=1), config=CONFIG, options=options)
  before = TRACE_COUNTS["ar"]
  ar.generate(params(), prompts(seed=2), config=CONFIG, options=options)
  assert TRACE_COUNTS["ar"] == before
  with pytest.raises(ValueError, match="causal"):
    ar.generate(params(), prompts(), config=preset("tiny-llada"), options=options)
