"""The sampler driver: per-row keys make a row's sample independent of its batch (with a batch-invariant
padding layout), prompt and key validation, and the statistics layouts a `Trace` exposes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlm_jax.instrument import interventions as iv
from dlm_jax import model
from dlm_jax.config import preset
from dlm_jax.sampling import autoregressive, dream, llada
from dlm_jax.instrument.stats import StatsSpec
from dlm_jax.sampling.run_setup import RunSetup

jax.config.update("jax_default_matmul_precision", "highest")


@functools.lru_cache(maxsize=None)
def params_for(name):
  return model.init_params(preset(name), jax.random.key(11))


SHORT, LONG = np.array([17, 42, 9, 101]), np.array([5, 77, 33, 64, 12, 150, 8])


def batch_of(first, second, pad_id):
  """Left-padded [2, Lp] prompts and their mask."""
  lp = max(len(first), len(second))
  prompt = np.full((2, lp), pad_id, np.int32)
  mask = np.zeros((2, lp), np.int32)
  for row, ids in enumerate((first, second)):
    prompt[row, lp - len(ids):], mask[row, lp - len(ids):] = ids, 1
  return prompt, mask


def item_keys(*item_ids):
  return jax.vmap(lambda i: jax.random.fold_in(jax.random.key(2024), i))(jnp.asarray(item_ids))


SAMPLERS = {
    "llada": ("tiny-llada", lambda p, x, **kw: llada.generate(p, x, config=preset("tiny-llada"), **kw),
              llada.LLaDAOptions(gen_length=8, steps=8, block_length=4, temperature=0.9, padding="key",
                                 shift_positions=True)),
    "dream": ("tiny-dream", lambda p, x, **kw: dream.diffusion_generate(p, x, config=preset("tiny-dream"), **kw),
              dream.DreamOptions(gen_length=8, steps=6, alg="maskgit_plus", temperature=0.9, alg_temp=0.5)),
    "ar": ("tiny-llama", lambda p, x, **kw: autoregressive.generate(p, x, config=preset("tiny-llama"), **kw),
           autoregressive.AROptions(gen_length=6, temperature=0.9, top_k=50)),
}


@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_row_keys_make_a_sample_independent_of_its_batch(name):
  """Item 0 alone, then beside item 1 in either row of a left-padded batch: with a per-item key and a
  batch-invariant layout its sample (temperature > 0) and statistics are the same."""
  config_name, run, options = SAMPLERS[name]
  params = params_for(config_name)
  spec = StatsSpec(incoming_attention=True, per_head=False)
  alone = run(params, SHORT[None], options=options, key=item_keys(0), stats_spec=spec)
  first, mask = batch_of(SHORT, LONG, pad_id=3)
  together = run(params, first, prompt_mask=mask, options=options, key=item_keys(0, 1), stats_spec=spec)
  second, mask2 = batch_of(LONG, SHORT, pad_id=3)
  swapped = run(params, second, prompt_mask=mask2, options=options, key=item_keys(1, 0), stats_spec=spec)
  pad = first.shape[1] - len(SHORT)
  for trace, row in ((together, 0), (swapped, 1)):
    np.testing.assert_array_equal(np.asarray(trace.generated)[row], np.asarray(alone.generated)[0])
    np.testing.assert_array_equal(np.asarray(trace.decode_step)[row], np.asarray(alone.decode_step)[0])
    incoming = np.asarray(trace.stats["incoming_attention"])[:, :, row, pad:]  # [steps, L, S] real keys
    np.testing.assert_allclose(incoming, np.asarray(alone.stats["incoming_attention"])[:, :, 0], atol=2e-5)
  # another key for row 0 draws another sample there: the keys, not the layout, carry the invariance
  others = run(params, first, prompt_mask=mask, options=options, key=item_keys(3, 1), stats_spec=spec)
  assert not np.array_equal(np.asarray(others.generated)[0], np.asarray(together.generated)[0])


def test_single_and_raw_keys_give_the_same_draws():
  config_name, run, options = SAMPLERS["llada"]
  params = params_for(config_name)
  typed = run(params, SHORT[None], options=options, key=jax.random.key(5))
  raw = run(params, SHORT[None], options=options, key=jax.random.PRNGKey(5))
  np.testing.assert_array_equal(np.asarray(typed.tokens), np.asarray(raw.tokens))


@pytest.mark.parametrize("bad, message", [
    (dict(prompt=np.zeros((2, 3), np.float32)), "integer token ids"),
    (dict(prompt=np.zeros((3,), np.int32)), r"\[B, Lp\]"),
    (dict(prompt_mask=np.ones((2, 4), np.int32)), "prompt_mask must have the prompt's shape"),
    (dict(key=jax.random.split(jax.random.key(0), 3)), r"per-row keys must have the batch shape \(2,\)"),
    (dict(key=jnp.zeros((4,), jnp.float32)), "key must be a PRNG key"),
    (dict(loop="eager"), "loop must be"),
])
def test_bad_inputs_are_named(bad, message):
  config = preset("tiny-llada")
  args = dict(prompt=np.zeros((2, 3), np.int32)) | bad
  prompt = args.pop("prompt")
  with pytest.raises(ValueError, match=message):
    llada.generate(params_for("tiny-llada"), prompt, config=config,
                   options=llada.LLaDAOptions(gen_length=4, steps=2, block_length=4), **args)


def test_dream_and_ar_refuse_empty_prompts():
  with pytest.raises(ValueError, match="at least 1 token"):
    dream.diffusion_generate(params_for("tiny-dream"), np.zeros((1, 0), np.int32), config=preset("tiny-dream"),
                             options=dream.DreamOptions(gen_length=4, steps=2))
  with pytest.raises(ValueError, match="at least 1 token"):
    autoregressive.generate(params_for("tiny-llama"), np.zeros((1, 0), np.int32), config=preset("tiny-llama"),
                            options=autoregressive.AROptions(gen_length=2))


@pytest.mark.parametrize("per_head, groups", [(True, 0), (False, 0), (True, 3), (False, 3)])
def test_trace_statistics_are_squeezed_once_at_the_edge(per_head, groups):
  """[steps, L', B, (Q,) (N,) S]; top sinks [steps, L', B, (N,) k]; composed interventions record a tuple."""
  config = preset("tiny-llada")
  options = llada.LLaDAOptions(gen_length=4, steps=2, block_length=4)
  composed = iv.Compose((iv.MaskKeys(), iv.MaskPreviousSinks(top_k=1)))
  trace = llada.generate(params_for("tiny-llada"), SHORT[None], config=config, options=options,
                         stats_spec=StatsSpec(incoming_attention=True, per_head=per_head, layers=(1,),
                                              query_groups=groups),
                         sink_top_k=2, intervention=composed, record_intervention=True)
  heads = (config.n_heads,) if per_head else ()
  assert trace.stats["incoming_attention"].shape == (2, 1, 1) + ((3,) if groups else ()) + heads + (8,)
  assert trace.top_sinks.shape == (2, 1, 1) + heads + (2,)
  keys_masked, sinks_masked = trace.intervention_record
  assert keys_masked.shape == (2, 1, 8) and not np.asarray(keys_masked).any()
  assert sinks_masked.shape == (2, config.n_layers, 1, config.n_heads, 8)
  assert not np.asarray(sinks_masked)[0].any() and np.asarray(sinks_masked)[1].sum(-1).min() == 1
  assert llada.generate(params_for("tiny-llada"), SHORT[None], config=config, options=options,
                        setup=RunSetup(intervention=composed)).intervention_record is None
