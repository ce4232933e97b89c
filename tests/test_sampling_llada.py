"""LLaDA / MMaDA sampler: token-identical to a NumPy re-implementation of the official `generate` at
temperature 0 (models.md §2.8, §4.5–4.6), padding behaviours, loop equivalence, seeds, statistics,
early stop and retracing."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlm_jax.instrument import interventions as iv
from dlm_jax import model
from dlm_jax.model.attention import MASK_VALUE, AttentionBias
from dlm_jax.config import preset
from dlm_jax.sampling import llada
from dlm_jax.sampling.driver import TRACE_COUNTS
from dlm_jax.instrument.stats import StatsSpec
from dlm_jax.model import CallInstruments, Compute
from dlm_jax.sampling.run_setup import RunSetup

jax.config.update("jax_default_matmul_precision", "highest")

CONFIG = preset("tiny-llada")
MASK, EOS, EOT, PAD = CONFIG.mask_token_id, CONFIG.eos_token_id, CONFIG.eot_token_id, CONFIG.pad_token_id


@functools.lru_cache(maxsize=None)
def params_for(kind: str = "plain"):
  params = model.init_params(CONFIG, jax.random.key(1))
  head = params["lm_head"]["kernel"]
  if kind == "eos_heavy":  # EOS / EoT copy frequent tokens' columns, so they often win the argmax
    noise = 0.005 * jax.random.normal(jax.random.key(5), (head.shape[0], 2))
    head = head.at[:, EOS].set(head[:, 238] * 1.1 + noise[:, 0]).at[:, EOT].set(head[:, 13] * 1.05 + noise[:, 1])
  if kind == "eot_everywhere":  # a constant feature in dimension 0 that only the EoT column reads
    params["embed"]["embedding"] = params["embed"]["embedding"].at[:, 0].add(50.0)
    head = head.at[0, :].set(0.0).at[0, EOT].set(5.0)
  params["lm_head"]["kernel"] = head
  return params


def prompts(batch=2, length=6, seed=0):
  return np.random.default_rng(seed).integers(3, 200, size=(batch, length)).astype(np.int32)


@functools.partial(jax.jit, static_argnames=("config",))
def _reference_logits(params, tokens, key_bias, pairwise_bias, *, config):
  return model.forward(params, tokens, config=config,
                       instruments=CallInstruments(bias=AttentionBias(keys=key_bias, pairwise=pairwise_bias)),
                       compute=Compute(attention_impl="dense")).logits


def _softmax(x):
  x = x - np.max(x, axis=-1, keepdims=True)
  e = np.exp(x)
  return e / e.sum(-1, keepdims=True)


def reference_generate(params, prompt, *, steps, gen_length, block_length, cfg_scale=0.0, logits_eos_inf=False,
                       confidence_eos_eot_inf=False, prompt_mask=None, padding="visible", cfg_padding=True,
                       stop_token=None):
  """The official generate() at temperature 0, low_confidence, written from models.md §2.8 / §4.5–4.6."""
  b, lp = prompt.shape
  x = np.full((b, lp + gen_length), MASK, np.int64)
  x[:, :lp] = prompt
  prompt_index = x != MASK
  key_bias = pair_bias = None
  if prompt_mask is not None and padding != "visible":
    valid = np.concatenate([prompt_mask.astype(bool), np.ones((b, gen_length), bool)], axis=1)
    if padding == "key":
      key_bias = np.where(valid, 0.0, MASK_VALUE).astype(np.float32)[:, None, :]
    else:
      pair_bias = np.where(valid[:, :, None] & valid[:, None, :], 0.0, MASK_VALUE).astype(np.float32)[:, None]
  assert gen_length % block_length == 0
  num_blocks = gen_length // block_length
  assert steps % num_blocks == 0
  steps_per_block = steps // num_blocks
  decode_step = np.full((b, gen_length), -1)
  step = nfe = 0
  for block in range(num_blocks):
    start, end = lp + block * block_length, lp + (block + 1) * block_length
    if stop_token is not None and block > 0 and np.all(x[:, start - 1] == stop_token):
      break
    masks_in_block = (x[:, start:end] == MASK).sum(1)
    schedule = [[m // steps_per_block + (s < m % steps_per_block) for s in range(steps_per_block)]
                for m in masks_in_block]
    for s in range(steps_per_block):
      mask_index = x == MASK
      if cfg_scale > 0:
        un_x = np.where(prompt_index, MASK, x)
        both = np.concatenate([x, un_x])
        kb = None if key_bias is None else np.concatenate([key_bias, key_bias if cfg_padding else 0 * key_bias])
        pb = None if pair_bias is None else np.concatenate([pair_bias, pair_bias if cfg_padding else 0 * pair_bias])
        out = np.asarray(_reference_logits(params, jnp.asarray(both, jnp.int32), kb, pb, config=CONFIG), np.float64)
        cond, un = out[:b], out[b:]
        logits = un + (cfg_scale + 1) * (cond - un)
      else:
        logits = np.asarray(_reference_logits(params, jnp.asarray(x, jnp.int32), key_bias, pair_bias, config=CONFIG),
                            np.float64)
      nfe += 1
      if logits_eos_inf:
        logits[:, :, EOS] = -np.inf
      x0 = np.argmax(logits, axis=-1)
      if confidence_eos_eot_inf:  # at temperature 0 the noisy and clean logits are one tensor
        logits[:, :, EOS] = -np.inf
        logits[:, :, EOT] = -np.inf
      p = _softmax(logits)
      x0_p = np.take_along_axis(p, x0[..., None], -1)[..., 0]
      x0_p[:, end:] = -np.inf
      x0 = np.where(mask_index, x0, x)
      confidence = np.where(mask_index, x0_p, -np.inf)
      before = x.copy()
      for j in range(b):
        chosen = np.argsort(-confidence[j], kind="stable")[:schedule[j][s]]
        x[j, chosen] = x0[j, chosen]
      newly = (before[:, lp:] == MASK) & (x[:, lp:] != MASK)
      decode_step[newly] = step
      step += 1
  return x, decode_step, nfe


CASES = {
    "semi_ar": dict(gen_length=16, steps=8, block_length=4),
    "pure_uneven": dict(gen_length=12, steps=5, block_length=12),
    "more_steps_than_tokens": dict(gen_length=8, steps=12, block_length=4),
    "cfg": dict(gen_length=8, steps=4, block_length=4, cfg_scale=1.5),
    "logits_eos_inf": dict(gen_length=12, steps=6, block_length=6, logits_eos_inf=True),
    "confidence_eos_eot_inf": dict(gen_length=12, steps=6, block_length=6, confidence_eos_eot_inf=True),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_numpy_reference_at_temperature_zero(name):
  case = CASES[name]
  params = params_for("eos_heavy" if "eos" in name else "plain")
  prompt = prompts()
  trace = llada.generate(params, prompt, config=CONFIG, options=llada.LLaDAOptions(**case))
  tokens, decode_step, nfe = reference_generate(params, prompt, **case)
  np.testing.assert_array_equal(np.asarray(trace.tokens), tokens)
  np.testing.assert_array_equal(np.asarray(trace.decode_step), decode_step)
  assert int(trace.nfe) == nfe == case["steps"]
  if "eos" in name:  # the knob had something to act on
    plain = reference_generate(params, prompt, **{k: v for k, v in case.items() if "eos" not in k})[0]
    assert not np.array_equal(plain, tokens)


def test_masks_inside_the_prompt_are_filled_as_in_the_reference():
  """Infilling: the prompt's own mask tokens may transfer in any block (whole-sequence logits variant)."""
  case = dict(gen_length=8, steps=8, block_length=4)
  prompt = np.array(prompts())
  prompt[:, 2] = MASK
  trace = llada.generate(params_for(), prompt, config=CONFIG, options=llada.LLaDAOptions(**case))
  tokens, decode_step, _ = reference_generate(params_for(), prompt, **case)
  np.testing.assert_array_equal(np.asarray(trace.tokens), tokens)
  np.testing.assert_array_equal(np.asarray(trace.decode_step), decode_step)
  assert not np.any(tokens[:, 2] == MASK)


def test_mmada_matches_reference_with_outer_padding():
  prompt = prompts(2, 7, seed=3)
  prompt_mask = np.ones_like(prompt)
  prompt_mask[1, :3] = 0
  prompt[1, :3] = PAD
  options = llada.mmada_options(gen_length=8, steps=8, block_length=4)
  trace = llada.generate(params_for(), prompt, config=CONFIG, options=options, prompt_mask=prompt_mask)
  tokens, decode_step, _ = reference_generate(params_for(), prompt, gen_length=8, steps=8, block_length=4,
                                              prompt_mask=prompt_mask, padding="outer")
  np.testing.assert_array_equal(np.asarray(trace.tokens), tokens)
  np.testing.assert_array_equal(np.asarray(trace.decode_step), decode_step)


def test_mmada_cfg_calls_are_unmasked():
  prompt = prompts(2, 7, seed=4)
  prompt_mask = np.ones_like(prompt)
  prompt_mask[0, :2] = 0
  prompt[0, :2] = PAD
  case = dict(gen_length=8, steps=4, block_length=8, cfg_scale=0.7)
  trace = llada.generate(params_for(), prompt, config=CONFIG, options=llada.mmada_options(**case),
                         prompt_mask=prompt_mask)
  tokens, decode_step, _ = reference_generate(params_for(), prompt, prompt_mask=prompt_mask, padding="outer",
                                              cfg_padding=False, **case)
  np.testing.assert_array_equal(np.asarray(trace.tokens), tokens)
  np.testing.assert_array_equal(np.asarray(trace.decode_step), decode_step)


@pytest.mark.parametrize("padding", ["key", "outer"])
def test_prompt_alone_equals_left_padded_batch(padding):
  rng = np.random.default_rng(7)
  short, long = rng.integers(3, 200, size=5), rng.integers(3, 200, size=9)
  batch = np.full((2, 9), PAD, np.int32)
  batch[0, 4:], batch[1] = short, long
  mask = (np.arange(9)[None, :] >= np.array([[4], [0]])).astype(np.int32)
  options = llada.LLaDAOptions(gen_length=8, steps=8, block_length=4, padding=padding)
  together = llada.generate(params_for(), batch, config=CONFIG, options=options, prompt_mask=mask)
  alone = llada.generate(params_for(), short[None], config=CONFIG, options=options)
  np.testing.assert_array_equal(np.asarray(together.generated)[0], np.asarray(alone.generated)[0])
  np.testing.assert_array_equal(np.asarray(together.decode_step)[0], np.asarray(alone.decode_step)[0])


def test_pads_visible_matches_reference():
  prompt = prompts(2, 6, seed=5)
  prompt_mask = np.ones_like(prompt)
  prompt_mask[0, :2] = 0
  prompt[0, :2] = PAD
  options = llada.LLaDAOptions(gen_length=8, steps=4, block_length=8, padding="visible")
  trace = llada.generate(params_for(), prompt, config=CONFIG, options=options, prompt_mask=prompt_mask)
  tokens, _, _ = reference_generate(params_for(), prompt, gen_length=8, steps=4, block_length=8)
  np.testing.assert_array_equal(np.asarray(trace.tokens), tokens)


def _stats_run(loop, **kw):
  options = llada.LLaDAOptions(gen_length=8, steps=4, block_length=4, temperature=0.8, remasking="random")
  state = iv.MaskKeys().init_state(CONFIG, 2, 14)
  state = iv.MaskKeys.with_positions(state, jnp.asarray([[1], [2]]))
  return llada.generate(params_for(), prompts(), config=CONFIG, options=options, key=jax.random.key(3),
                        stats_spec=StatsSpec(incoming_attention=True, query_groups=3), sink_top_k=2,
                        intervention=iv.MaskKeys(), intervention_state=state, loop=loop, **kw)


def test_compiled_loop_equals_python_loop():
  scan, python = _stats_run("scan"), _stats_run("python")
  np.testing.assert_array_equal(np.asarray(scan.tokens), np.asarray(python.tokens))
  np.testing.assert_array_equal(np.asarray(scan.decode_step), np.asarray(python.decode_step))
  np.testing.assert_allclose(np.asarray(scan.stats["incoming_attention"]),
                             np.asarray(python.stats["incoming_attention"]), atol=1e-5)
  np.testing.assert_array_equal(np.asarray(scan.top_sinks), np.asarray(python.top_sinks))
  # the intervention acted at every step: the masked keys receive nothing
  incoming = np.asarray(scan.stats["incoming_attention"])  # [steps, L, B, Q, N, S]
  assert np.all(incoming[:, :, 0, :, :, 1] == 0) and np.all(incoming[:, :, 1, :, :, 2] == 0)


def test_same_seed_same_tokens_and_different_seed_differs():
  options = llada.LLaDAOptions(gen_length=16, steps=8, block_length=8, temperature=1.0)
  run = lambda seed: np.asarray(llada.generate(params_for(), prompts(), config=CONFIG, options=options,
                                               key=jax.random.key(seed)).tokens)
  np.testing.assert_array_equal(run(0), run(0))
  assert not np.array_equal(run(0), run(1))


def test_no_retrace_for_new_prompt_of_same_length():
  options = llada.LLaDAOptions(gen_length=8, steps=4, block_length=4)
  llada.generate(params_for(), prompts(seed=10), config=CONFIG, options=options)
  before = TRACE_COUNTS["llada"]
  llada.generate(params_for(), prompts(seed=11), config=CONFIG, options=options)
  llada.generate(params_for(), prompts(seed=12), config=CONFIG, options=options, key=jax.random.key(5))
  assert TRACE_COUNTS["llada"] == before


def test_schedule_is_respected_with_random_remasking():
  options = llada.LLaDAOptions(gen_length=12, steps=10, block_length=6, temperature=0.5, remasking="random")
  trace = llada.generate(params_for(), prompts(), config=CONFIG, options=options, key=jax.random.key(9))
  decode_step = np.asarray(trace.decode_step)
  for row in decode_step:
    per_step = np.bincount(row, minlength=10)
    np.testing.assert_array_equal(per_step, [2, 1, 1, 1, 1] * 2)  # 6 masks in 5 steps: 2,1,1,1,1
    assert np.all(row[:6] < 5) and np.all(row[6:] >= 5)  # semi-autoregressive blocks


def test_statistics_equal_dense_recomputation():
  prompt = prompts()
  options = llada.LLaDAOptions(gen_length=8, steps=4, block_length=8)
  spec = StatsSpec(incoming_attention=True, query_groups=3)
  trace = llada.generate(params_for(), prompt, config=CONFIG, options=options,
                         setup=RunSetup(stats_spec=spec, sink_top_k=3))
  tokens, decode_step = np.asarray(trace.tokens), np.asarray(trace.decode_step)
  lp = prompt.shape[1]
  for t in range(options.steps):
    canvas = tokens.copy()
    canvas[:, lp:] = np.where((decode_step >= 0) & (decode_step < t), tokens[:, lp:], MASK)
    generated = np.arange(14) >= lp
    groups = np.stack([canvas == MASK, generated & (canvas != MASK), ~generated & (canvas != MASK)],
                      axis=1).astype(np.float32)
    dense = model.forward(params_for(), jnp.asarray(canvas), config=CONFIG, compute=Compute(attention_impl="dense"),
                          instruments=CallInstruments(stats_spec=spec,
                                                      query_weights=jnp.asarray(groups))).incoming_attention
    np.testing.assert_allclose(np.asarray(trace.stats["incoming_attention"][t]), np.asarray(dense), atol=2e-5)
    total = np.asarray(dense).sum(axis=2)  # [L, B, N, S]
    order = np.argsort(-total, axis=-1, kind="stable")[..., :3]
    np.testing.assert_array_equal(np.asarray(trace.top_sinks[t]), order)
  assert trace.stats["incoming_attention"].shape == (4, CONFIG.n_layers, 2, 3, CONFIG.n_heads, 14)


def test_stats_union_with_intervention_needs():
  """User stats head-averaged on one layer while MaskPreviousSinks reads per-head stats of all layers."""
  options = llada.LLaDAOptions(gen_length=8, steps=4, block_length=4)
  user = StatsSpec(incoming_attention=True, per_head=False, layers=(1,))
  masked = llada.generate(params_for(), prompts(), config=CONFIG, options=options,
                          setup=RunSetup(stats_spec=user, intervention=iv.MaskPreviousSinks(top_k=1)))
  plain_sinks = llada.generate(params_for(), prompts(), config=CONFIG, options=options,
                               setup=RunSetup(stats_spec=user, intervention=iv.MaskPreviousSinks(top_k=0)))
  plain = llada.generate(params_for(), prompts(), config=CONFIG, options=options, setup=RunSetup(stats_spec=user))
  assert masked.stats["incoming_attention"].shape == (4, 1, 2, 14)
  np.testing.assert_array_equal(np.asarray(plain_sinks.tokens), np.asarray(plain.tokens))
  np.testing.assert_allclose(np.asarray(plain_sinks.stats["incoming_attention"]),
                             np.asarray(plain.stats["incoming_attention"]), atol=1e-6)
  assert not np.allclose(np.asarray(masked.stats["incoming_attention"][1:]),
                         np.asarray(plain.stats["incoming_attention"][1:]))


def test_mmu_generate_fast_stops_at_end_of_turn():
  params = params_for("eot_everywhere")
  options = llada.mmada_options(gen_length=12, steps=6, block_length=4, stop_token_id=EOT)
  trace = llada.generate(params, prompts(), config=CONFIG, options=options,
                         setup=RunSetup(stats_spec=StatsSpec(incoming_attention=True)))
  tokens, decode_step, nfe = reference_generate(params, prompts(), gen_length=12, steps=6, block_length=4,
                                                stop_token=EOT)
  np.testing.assert_array_equal(np.asarray(trace.tokens), tokens)
  np.testing.assert_array_equal(np.asarray(trace.decode_step), decode_step)
  assert int(trace.nfe) == nfe == 2
  assert np.all(np.asarray(trace.tokens)[:, 6 + 4:] == MASK)
  assert np.all(np.asarray(trace.stats["incoming_attention"][2:]) == 0)


def test_confidence_eos_eot_rule_depends_on_temperature():
  """models.md §2.8e: at T = 0 both EOS and EoT get confidence 0; at T > 0 only EoT does."""
  logits = np.full((1, 2, 8), -4.0, np.float32)
  logits[0, 0, EOS] = 5.0  # position 0: EOS, very confident
  logits[0, 1, 5] = 1.0  # position 1: token 5, less confident
  canvas = jnp.full((1, 2), MASK, jnp.int32)

  def chosen(temperature):
    options = llada.LLaDAOptions(gen_length=2, steps=2, block_length=2, temperature=temperature,
                                 confidence_eos_eot_inf=True)
    family = llada.LLaDAFamily(options=options, mask_id=MASK, eos_id=EOS, eot_id=EOT)
    x0, x0_p = family._proposals(params_for(), jnp.asarray(logits), None, jax.random.key(0))
    return np.asarray(family._transfer(canvas, x0, x0_p, 2, jnp.asarray([1])))[0]

  np.testing.assert_array_equal(chosen(0.0), [MASK, 5])  # EOS confidence is 0 at T = 0
  np.testing.assert_array_equal(chosen(1e-6), [EOS, MASK])  # EOS keeps its confidence at T > 0


def test_errors_are_clear():
  with pytest.raises(ValueError, match="multiple of block_length"):
    llada.LLaDAOptions(gen_length=10, block_length=4)
  with pytest.raises(ValueError, match="multiple of the number of blocks"):
    llada.LLaDAOptions(gen_length=8, block_length=4, steps=3)
  with pytest.raises(ValueError, match="remasking"):
    llada.LLaDAOptions(remasking="nope")
  with pytest.raises(ValueError, match="prompt must be"):
    llada.generate(params_for(), np.zeros((3,), np.int32), config=CONFIG,
                   options=llada.LLaDAOptions(gen_length=4, steps=4, block_length=4))


def test_gumbel_argmax_samples_softmax_at_temperature():
  logits = jnp.asarray([1.0, 0.0, -0.5, 2.0])
  temperature = 0.7
  keys = jax.random.split(jax.random.key(0), 40000)
  draws = np.asarray(jax.vmap(lambda k: llada.gumbel_argmax(logits, temperature, k))(keys))
  expected = _softmax(np.asarray(logits, np.float64) / temperature)
  np.testing.assert_allclose(np.bincount(draws, minlength=4) / draws.size, expected, atol=0.01)
