"""Batched likelihood (`dlm_jax.analysis.likelihood_batch`): the draws have the estimators' structure, the pair losses
and whole estimates equal a NumPy replay of the same draws on unpadded sequences, estimates do not depend
on the batch a request lands in, and the estimators agree with exact values enumerated on small problems."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlm_jax import default_models, model
from dlm_jax.analysis import likelihood, likelihood_batch as lb
from dlm_jax.io import checkpoint
from dlm_jax.config import preset
from dlm_jax.model import Compute

jax.config.update("jax_default_matmul_precision", "highest")

DREAM = preset("tiny-dream")
REQUESTS = [([1, 54, 76, 22, 68], [13, 49, 11]), ([1, 20], [30, 31, 32, 33, 34]), ([1, 40, 41, 42], [50])]
BATCH = 32  # pairs per call everywhere, so the tests share compiled programs


@functools.lru_cache(maxsize=None)
def loaded(name):
  if name == "tiny-dream":
    return DREAM, model.init_params(DREAM, jax.random.key(3))
  return checkpoint.load(default_models.path(name), dtype=np.float32)


@functools.partial(jax.jit, static_argnames=("config",))
def _logits(params, tokens, *, config):
  return model.forward(params, tokens, config=config, compute=Compute(attention_impl="dense")).logits


def _log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _inputs(request, settings, draws, width=None):
  """The draw_masks inputs of `draws` of one request, as mc_log_likelihoods builds them (at its row width,
  or at `width`)."""
  context, continuation = request
  width = width or lb.shapes(len(context), len(continuation))[0]
  valid = np.arange(width) >= width - len(context) - len(continuation)
  key = np.asarray(jax.random.key_data(jax.random.fold_in(jax.random.key(0),
                                                          lb.request_key_number(context, continuation))))
  table = np.zeros((width, settings.group), np.int32)
  if settings.estimator == "llada":
    table[:len(continuation)] = likelihood.llada_mask_count_table(len(continuation), settings.group)
  n = len(draws)
  return (np.tile(valid, (n, 1)), np.full(n, len(continuation), np.int32), np.tile(key, (n, 1)),
          np.asarray(draws, np.int32), np.stack([table[:, d % settings.group] for d in draws]))


def _numpy_losses(name, request, masked, weight, settings):
  """Σ masked CE / weight per draw on the unpadded sequence (CFG and the shift written out here)."""
  config, params = loaded(name)
  seq = np.asarray(request[0] + request[1])
  length, lp = seq.size, len(request[0])
  masked = masked[:, -length:]
  noisy = np.where(masked, config.mask_token_id, seq[None, :])
  logits = np.asarray(_logits(params, jnp.asarray(noisy), config=config), np.float64)
  if settings.cfg_scale > 0:
    un = noisy.copy()
    un[:, :lp] = config.mask_token_id
    un_logits = np.asarray(_logits(params, jnp.asarray(un), config=config), np.float64)
    w = settings.cfg_scale + 1 if settings.estimator == "llada" else settings.cfg_scale
    logits = un_logits + w * (logits - un_logits)
  if config.logit_shift:  # the model's rule, whichever the estimator
    logits = np.concatenate([logits[:, :1], logits[:, :-1]], axis=1)
  ce = -np.take_along_axis(_log_softmax(logits), np.tile(seq, (len(noisy), 1))[..., None], -1)[..., 0]
  return np.where(masked, ce / weight[:, None], 0.0).sum(1)


def test_llada_draws_are_stratified_over_the_continuation():
  settings = lb.MCSettings("llada", mc_num=16, group=8)
  request = REQUESTS[1]
  masked, weight = lb.draw_masks(*_inputs(request, settings, list(range(16))), settings=settings)
  masked, weight = np.asarray(masked), np.asarray(weight)
  width = masked.shape[1]
  assert not masked[:, :width - 5].any()  # never outside the continuation
  table = likelihood.llada_mask_count_table(5, 8)
  for stratum in (masked[:8], masked[8:]):
    assert any(np.array_equal(stratum.sum(1), row) for row in table)
  np.testing.assert_allclose(weight, masked.sum(1) / 5)


def test_rows_are_padded_little_and_draws_do_not_depend_on_the_width():
  """Padding under max(8, L/8) tokens; a request's masks at its row width equal those drawn on a row as wide
  as the draw canvas (L rounded up to 32), aligned at the right end."""
  for length in range(1, 700):
    width = lb.row_width(length)
    assert length <= width < length + max(8, length / 8) and width % 8 == 0, (length, width)
  for estimator in lb.ESTIMATORS:
    settings = lb.MCSettings(estimator, mc_num=8, group=4)
    for request in (REQUESTS[1], ([1] + list(range(4, 46)), [50, 51, 52, 53, 54, 55, 56, 57, 58, 59])):
      length = len(request[0]) + len(request[1])
      masks = [np.asarray(lb.draw_masks(*_inputs(request, settings, list(range(8)), width), settings=settings)[0])
               for width in (lb.row_width(length), -(-length // 32) * 32)]
      assert masks[0].shape[1] < masks[1].shape[1] and masks[0].any()
      np.testing.assert_array_equal(masks[0][:, -length:], masks[1][:, -length:])


def test_dream_draws_are_antithetic_and_spare_the_ends():
  settings = lb.MCSettings("dream", mc_num=8, group=8)
  request = REQUESTS[1]
  masked, p_mask = lb.draw_masks(*_inputs(request, settings, list(range(8))), settings=settings)
  masked, p_mask = np.asarray(masked), np.asarray(p_mask)
  width = masked.shape[1]
  assert not masked[:, :width - 5].any() and not masked[:, -1].any()
  t = (p_mask - 1e-3) / (1 - 1e-3)
  np.testing.assert_allclose(np.diff(np.sort(t)), 1 / 8, atol=1e-5)


@pytest.mark.parametrize("name,estimator,cfg", [("tiny-dlm", "llada", 1.5), ("tiny-dream", "dream", 2.0),
                                                ("tiny-dream", "llada", 0.0)])
def test_estimate_equals_numpy_replay_of_the_same_draws(name, estimator, cfg):
  """With CFG (the conditional half is the unguided program); REQUESTS[:2] (one continuation is too short
  for Dream, whose last position is never masked). LLaDA's estimator on a shifted model reads the shifted
  predictions."""
  config, params = loaded(name)
  settings = lb.MCSettings(estimator, mc_num=8, group=4, cfg_scale=cfg)
  got = lb.mc_log_likelihoods(params, REQUESTS[:2], config=config, settings=settings, seed=0, batch_size=BATCH)
  for request, estimate in zip(REQUESTS[:2], got):
    masked, weight = lb.draw_masks(*_inputs(request, settings, list(range(8))), settings=settings)
    expected = -_numpy_losses(name, request, np.asarray(masked), np.asarray(weight, np.float64), settings).sum() / 8
    np.testing.assert_allclose(estimate, expected, rtol=2e-5, atol=1e-5)


def test_estimates_do_not_depend_on_the_batch():
  config, params = loaded("tiny-dlm")
  settings = lb.MCSettings("llada", mc_num=8, group=4)
  together = lb.mc_log_likelihoods(params, REQUESTS, config=config, settings=settings, batch_size=BATCH)
  alone = [lb.mc_log_likelihoods(params, [r], config=config, settings=settings, batch_size=BATCH)[0]
           for r in REQUESTS]
  reordered = lb.mc_log_likelihoods(params, REQUESTS[::-1] + [([1, 7], [8, 9, 10])], config=config,
                                    settings=settings, batch_size=BATCH)[:3][::-1]
  np.testing.assert_allclose(together, alone, rtol=1e-6)
  np.testing.assert_allclose(together, reordered, rtol=1e-6)


def _subset_ce(name, seq, positions, shift):
  config, params = loaded(name)
  noisy = np.asarray(seq).copy()
  noisy[list(positions)] = config.mask_token_id
  logits = np.asarray(_logits(params, jnp.asarray(noisy[None]), config=config), np.float64)[0]
  if shift:
    logits = np.concatenate([logits[:1], logits[:-1]])
  log_probs = _log_softmax(logits)
  return sum(-log_probs[j, seq[j]] for j in positions)


def test_llada_estimate_matches_the_enumerated_bound():
  context, continuation = [1, 54, 76, 22], [13, 49, 11]
  seq, lp, t = context + continuation, len(context), len(continuation)
  bound = sum((1 / t) * (t / n) * np.mean([_subset_ce("tiny-dlm", seq, s, False)
                                           for s in itertools.combinations(range(lp, lp + t), n)])
              for n in range(1, t + 1))
  config, params = loaded("tiny-dlm")
  settings = lb.MCSettings("llada", mc_num=384, group=4)
  draws = list(range(384))
  masked, weight = lb.draw_masks(*_inputs((context, continuation), settings, draws), settings=settings)
  losses = _numpy_losses("tiny-dlm", (context, continuation), np.asarray(masked), np.asarray(weight, np.float64),
                         settings)
  strata = losses.reshape(-1, 4).mean(1)
  estimate = lb.mc_log_likelihoods(params, [(context, continuation)], config=config, settings=settings,
                                   batch_size=BATCH)[0]
  assert abs(-estimate - bound) < 4 * strata.std() / np.sqrt(len(strata)), (estimate, bound)
  # One continuation token: every draw masks it with weight 1, so the estimate is exact.
  single = lb.mc_log_likelihoods(params, [(context, continuation[:1])], config=config,
                                 settings=lb.MCSettings("llada", mc_num=4, group=4), batch_size=BATCH)[0]
  np.testing.assert_allclose(-single, _subset_ce("tiny-dlm", context + continuation[:1], [lp], False), rtol=1e-5)


def test_dream_estimate_matches_the_enumerated_bound():
  context, continuation = [1, 20, 21], [30, 31, 32]
  seq, lp, eps = context + continuation, len(context), 1e-3
  maskable = list(range(lp, len(seq) - 1))  # the last position is never masked
  nodes, weights = np.polynomial.legendre.leggauss(24)
  ts, ws = (nodes + 1) / 2, weights / 2
  p = (1 - eps) * ts + eps
  bound = sum(_subset_ce("tiny-dream", seq, s, True) * np.sum(ws * p ** n * (1 - p) ** (len(maskable) - n) / p)
              for n in range(1, len(maskable) + 1) for s in itertools.combinations(maskable, n))
  config, params = loaded("tiny-dream")
  settings = lb.MCSettings("dream", mc_num=256, group=4)
  masked, weight = lb.draw_masks(*_inputs((context, continuation), settings, list(range(256))), settings=settings)
  strata = _numpy_losses("tiny-dream", (context, continuation), np.asarray(masked), np.asarray(weight, np.float64),
                         settings).reshape(-1, 4).mean(1)
  estimate = lb.mc_log_likelihoods(params, [(context, continuation)], config=config, settings=settings,
                                   batch_size=BATCH)[0]
  assert abs(-estimate - bound) < 4 * strata.std() / np.sqrt(len(strata)), (estimate, bound)


def test_teacher_forcing_is_the_exact_chain_rule_and_normalised():
  config, params = loaded("tiny-arm")
  batch = 96  # one compiled program: every request here has S = 32, W = 8
  scores, greedy = lb.ar_log_likelihoods(params, REQUESTS, config=config, batch_size=batch)
  for (context, continuation), score, flag in zip(REQUESTS, scores, greedy):
    seq = np.asarray(context + continuation)
    log_probs = _log_softmax(np.asarray(_logits(params, jnp.asarray(seq[None]), config=config), np.float64)[0])
    rows = np.arange(len(context) - 1, seq.size - 1)
    np.testing.assert_allclose(score, log_probs[rows, seq[rows + 1]].sum(), rtol=1e-5)
    assert flag == bool(np.all(log_probs[rows].argmax(-1) == seq[rows + 1]))
  context = [1, 54, 76]
  every = [(context, [v]) for v in range(config.vocab_size)]
  single, _ = lb.ar_log_likelihoods(params, every, config=config, batch_size=batch)
  np.testing.assert_allclose(np.exp(single).sum(), 1.0, rtol=1e-5)


def test_bad_requests_are_refused():
  config, params = loaded("tiny-arm")
  with pytest.raises(ValueError, match="mask token"):
    lb.mc_log_likelihoods(params, REQUESTS, config=config, settings=lb.MCSettings())
  with pytest.raises(ValueError, match="mc_num=10"):
    lb.MCSettings("llada", mc_num=10, group=4)
  with pytest.raises(ValueError, match="at least one context token"):
    lb.ar_log_likelihoods(params, [([], [5])], config=config)


def test_estimates_are_the_same_on_a_mesh():
  """Pairs sharded over data × fsdp, parameters over fsdp / tensor (`sharding.param_shardings`)."""
  from dlm_jax.runtime import sharding  # pylint: disable=import-outside-toplevel
  config, params = loaded("tiny-dlm")
  settings = lb.MCSettings("llada", mc_num=8, group=4, cfg_scale=0.5)
  single = lb.mc_log_likelihoods(params, REQUESTS, config=config, settings=settings, batch_size=BATCH)
  mesh = sharding.make_mesh(2, 2, 2, devices=jax.devices()[:8])
  placed = jax.device_put(params, sharding.param_shardings(config, mesh, params))
  sharded = lb.mc_log_likelihoods(placed, REQUESTS, config=config, settings=settings, batch_size=BATCH, mesh=mesh)
  np.testing.assert_allclose(sharded, single, rtol=1e-5)
  arm_config, arm_params = loaded("tiny-arm")
  placed = jax.device_put(arm_params, sharding.param_shardings(arm_config, mesh, arm_params))
  np.testing.assert_allclose(lb.ar_log_likelihoods(placed, REQUESTS, config=arm_config, batch_size=96, mesh=mesh)[0],
                             lb.ar_log_likelihoods(arm_params, REQUESTS, config=arm_config, batch_size=96)[0],
                             rtol=1e-5)
