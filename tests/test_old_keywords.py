"""The deprecated keywords of the call path's entry points (`dlm_jax.core.old_keywords`): `forward`, every
sampler, `attention` and `block_sparse_attention` still take their old keywords, give results bitwise equal to
the new structs' and warn once naming the new field; an old keyword with its struct, or an unknown keyword, is a
TypeError."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlm_jax import model
from dlm_jax.config import preset
from dlm_jax.core.attention_bias import AttentionBias
from dlm_jax.instrument.stats import StatsSpec
from dlm_jax.model import CallInstruments, Compute, Readout
from dlm_jax.model.attention import AttentionComputation, Visibility, attention
from dlm_jax.model.block_sparse_attention import KeyBlocks, block_sparse_attention
from dlm_jax.sampling import autoregressive, block_diffusion, diffusion_gemma, driver, dream, llada
from dlm_jax.sampling.run_setup import RunSetup

jax.config.update("jax_default_matmul_precision", "highest")

SPEC = StatsSpec(incoming_attention=True, per_head=False)


@functools.lru_cache(maxsize=None)
def params_for(name):
  return model.init_params(preset(name), jax.random.key(5))


def _one_deprecation(call, expected: str):
  """call()'s result; asserts it warned exactly one DeprecationWarning, whose text holds `expected`."""
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    result = call()
  deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
  assert len(deprecations) == 1, [str(w.message) for w in deprecations]
  assert expected in str(deprecations[0].message)
  assert deprecations[0].filename == __file__  # points at the caller
  return result


def test_forward_old_keywords_equal_the_structs():
  config = preset("tiny-llada")
  params = params_for("tiny-llada")
  tokens = jnp.asarray([[3, 9, 27, 4, 81, 6]], jnp.int32)
  bias = AttentionBias(keys=jnp.zeros((1, 1, 6)).at[..., 2].set(-1e9))
  new = model.forward(params, tokens, config=config, instruments=CallInstruments(bias=bias, stats_spec=SPEC),
                      readout=Readout(window=(2, 5)), compute=Compute(attention_impl="dense"))
  old = _one_deprecation(lambda: model.forward(params, tokens, config=config, bias=bias, stats_spec=SPEC,
                                               logits_window=(2, 5), attention_impl="dense"),
                         "use instruments=CallInstruments(bias=..., stats_spec=...), readout=Readout(window=...), "
                         "compute=Compute(attention_impl=...).")
  assert new.logits.shape == (1, 3, config.vocab_size)
  np.testing.assert_array_equal(old.logits, new.logits)
  np.testing.assert_array_equal(old.stats["incoming_attention"], new.stats["incoming_attention"])
  with pytest.raises(TypeError, match=r"forward\(\) got both stats_spec= and instruments="):
    model.forward(params, tokens, config=config, instruments=CallInstruments(), stats_spec=SPEC)
  with pytest.raises(TypeError, match="unexpected keyword argument 'logit_window'"):
    model.forward(params, tokens, config=config, logit_window=(0, 1))


def _llada_family(config, options, prompt):
  return llada._family(config, options, prompt)  # pylint: disable=protected-access


SAMPLERS = {
    "llada.generate": ("tiny-llada", llada.generate, llada.LLaDAOptions(gen_length=8, steps=4, block_length=4)),
    "dream.diffusion_generate": ("tiny-dream", dream.diffusion_generate, dream.DreamOptions(gen_length=8, steps=4)),
    "driver.run_family": ("tiny-llada", None, llada.LLaDAOptions(gen_length=8, steps=4, block_length=4)),
    "diffusion_gemma.generate": ("tiny-diffusiongemma", diffusion_gemma.generate,
                                 diffusion_gemma.DiffusionGemmaOptions(gen_length=8, canvas_length=4,
                                                                       max_denoising_steps=3)),
    "block_diffusion.generate": ("tiny-llada2", block_diffusion.generate,
                                 block_diffusion.BlockDiffusionOptions(gen_length=8, block_length=4, steps=2)),
    "autoregressive.generate": ("tiny-llama", autoregressive.generate, autoregressive.AROptions(gen_length=4)),
}


@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_sampler_old_keywords_equal_the_setup(name):
  config_name, generate, options = SAMPLERS[name]
  config = preset(config_name)
  params = params_for(config_name)
  prompt = np.array([[17, 42, 9, 31]], np.int32)
  if generate is None:
    family = _llada_family(config, options, prompt)
    run = lambda **kw: driver.run_family(family, params, prompt, config=config, key=jax.random.key(1), **kw)  # noqa: E731
  else:
    run = functools.partial(generate, params, prompt, config=config, options=options, key=jax.random.key(1))
  new = run(setup=RunSetup(stats_spec=SPEC, sink_top_k=1))
  old = _one_deprecation(lambda: run(stats_spec=SPEC, sink_top_k=1),
                         "(stats_spec=, sink_top_k=) is deprecated; use setup=RunSetup(stats_spec=..., "
                         "sink_top_k=...).")
  np.testing.assert_array_equal(old.tokens, new.tokens)
  np.testing.assert_array_equal(old.stats["incoming_attention"], new.stats["incoming_attention"])
  np.testing.assert_array_equal(old.top_sinks, new.top_sinks)
  with pytest.raises(TypeError, match=r"got both loop= and setup="):
    run(setup=RunSetup(), loop="python")
  with pytest.raises(TypeError, match="unexpected keyword argument 'stat_spec'"):
    run(stat_spec=SPEC)


def test_attention_old_keywords_equal_the_structs():
  """`attention` and `block_sparse_attention` (issue 35's last two call-path functions over 8 parameters)."""
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=(1, 6, 4, 8)), jnp.float32) for _ in range(3))
  keys = jnp.zeros((1, 1, 6)).at[..., 4].set(-1e9)
  weights = jnp.ones((1, 1, 6))
  new = attention(q, k, v, scale=0.3, visibility=Visibility(causal=True, window=3),
                  bias=AttentionBias(keys=keys), computation=AttentionComputation(query_weights=weights,
                                                                                 with_incoming=True, impl="dense"))
  old = _one_deprecation(lambda: attention(q, k, v, scale=0.3, causal=True, window=3, key_bias=keys,
                                           query_weights=weights, with_incoming=True, impl="dense"),
                         "use visibility=Visibility(causal=..., window=...), bias=AttentionBias(keys=...), "
                         "computation=AttentionComputation(query_weights=..., with_incoming=..., impl=...).")
  assert np.abs(np.asarray(new[1])).sum() > 0
  for a, b in zip(old, new):
    np.testing.assert_array_equal(a, b)
  with pytest.raises(TypeError, match=r"attention\(\) got both causal= and visibility="):
    attention(q, k, v, scale=0.3, visibility=Visibility(), causal=True)
  blocks = KeyBlocks(jnp.zeros((1, 4, 2, 1), jnp.int32), 3)
  new = block_sparse_attention(q, k, v, blocks, scale=0.3, bias=AttentionBias(keys=keys),
                               computation=AttentionComputation(query_weights=weights, with_incoming=True))
  old = _one_deprecation(lambda: block_sparse_attention(q, k, v, blocks, scale=0.3, key_bias=keys,
                                                        query_weights=weights, with_incoming=True),
                         "block_sparse_attention(key_bias=, query_weights=, with_incoming=) is deprecated")
  for a, b in zip(old, new):
    np.testing.assert_array_equal(a, b)
  with pytest.raises(TypeError, match="unexpected keyword argument 'causal'"):
    block_sparse_attention(q, k, v, blocks, scale=0.3, causal=True)
