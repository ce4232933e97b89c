"""Monte-Carlo likelihood: LLaDA's stratified counts equal torch's, minibatch losses equal a NumPy replay of
the same mask draws, and both estimators converge to the exact expectation on a tiny problem."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dlm_jax import model
from dlm_jax.analysis import likelihood
from dlm_jax.config import preset
from dlm_jax.model import Compute

jax.config.update("jax_default_matmul_precision", "highest")

LLADA, DREAM = preset("tiny-llada"), preset("tiny-dream")
PROMPT, ANSWER = np.array([5, 17, 42], np.int32), np.array([7, 99, 13, 64], np.int32)


@functools.lru_cache(maxsize=None)
def params(name):
  config = LLADA if name == "llada" else DREAM
  return model.init_params(config, jax.random.key(7))


@functools.partial(jax.jit, static_argnames=("config",))
def _logits(params, tokens, *, config):
  return model.forward(params, tokens, config=config, compute=Compute(attention_impl="dense")).logits


def _log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_llada_counts_match_torch_forward_process():
  for target_len in (1, 2, 3, 7, 10, 33, 100):
    for batch in (1, 2, 3, 4, 5, 8, 16, 32):
      table = likelihood.llada_mask_count_table(target_len, batch)
      for k in range(1, target_len + 1):
        kt = torch.tensor(k)
        x = torch.round(torch.linspace(float(kt), kt + (batch - 1) * (target_len / batch), steps=batch)).long()
        x = ((x - 1) % target_len) + 1
        np.testing.assert_array_equal(table[k - 1], x.numpy(), err_msg=f"T={target_len} b={batch} k={k}")


def test_llada_draws_mask_exact_counts():
  masks = np.asarray(likelihood.llada_mask_draws(jax.random.key(0), 8, 10))
  k_rows = masks.sum(1)
  table = likelihood.llada_mask_count_table(10, 8)
  assert any(np.array_equal(k_rows, row) for row in table)


def _llada_numpy_loss(seq, masks, cfg_scale=0.0, name="llada"):
  """LLaDA's minibatch loss written out; on Dream's (shifted) model position p reads the output at p − 1."""
  config = LLADA if name == "llada" else DREAM
  lp, t = PROMPT.size, ANSWER.size
  noisy = np.tile(seq, (masks.shape[0], 1))
  noisy[:, lp:][masks] = config.mask_token_id
  logits = np.asarray(_logits(params(name), jnp.asarray(noisy), config=config), np.float64)
  if cfg_scale > 0:
    un = noisy.copy()
    un[:, :lp] = config.mask_token_id
    un_logits = np.asarray(_logits(params(name), jnp.asarray(un), config=config), np.float64)
    logits = un_logits + (cfg_scale + 1) * (logits - un_logits)
  if config.logit_shift:
    logits = np.concatenate([logits[:, :1], logits[:, :-1]], axis=1)
  ce = -np.take_along_axis(_log_softmax(logits), np.tile(seq, (masks.shape[0], 1))[..., None], -1)[..., 0]
  ratio = masks.sum(1) / t
  per_row = np.where(noisy == config.mask_token_id, ce / ratio[:, None], 0.0).sum(1)
  return per_row.sum() / masks.shape[0]


@pytest.mark.parametrize("name,cfg_scale", [("llada", 0.0), ("llada", 1.5), ("dream", 0.0)])
def test_llada_minibatch_loss_equals_numpy_replay(name, cfg_scale):
  seq = np.concatenate([PROMPT, ANSWER])
  masks = likelihood.llada_mask_draws(jax.random.key(1), 4, ANSWER.size)
  config = LLADA if name == "llada" else DREAM
  got = likelihood.llada_minibatch_nll(params(name), jnp.asarray(seq), masks, config=config, prompt_len=PROMPT.size,
                                       cfg_scale=cfg_scale)
  np.testing.assert_allclose(float(got), _llada_numpy_loss(seq, np.asarray(masks), cfg_scale, name), rtol=1e-5)


def _dream_numpy_loss(seq, masks, p_mask, cfg_scale=0.0):
  lp = PROMPT.size
  noisy = np.where(masks, DREAM.mask_token_id, np.tile(seq, (masks.shape[0], 1)))
  logits = np.asarray(_logits(params("dream"), jnp.asarray(noisy), config=DREAM), np.float64)
  if cfg_scale > 0:
    un = noisy.copy()
    un[:, :lp] = DREAM.mask_token_id
    un_logits = np.asarray(_logits(params("dream"), jnp.asarray(un), config=DREAM), np.float64)
    logits = un_logits + cfg_scale * (logits - un_logits)
  logits = np.concatenate([logits[:, :1], logits[:, :-1]], axis=1)
  ce = -np.take_along_axis(_log_softmax(logits), np.tile(seq, (masks.shape[0], 1))[..., None], -1)[..., 0]
  return np.where(noisy == DREAM.mask_token_id, ce / p_mask[:, None], 0.0).sum() / masks.shape[0]


@pytest.mark.parametrize("cfg_scale", [0.0, 2.0])
def test_dream_minibatch_loss_equals_numpy_replay(cfg_scale):
  seq = np.concatenate([PROMPT, ANSWER])
  masks, p_mask = likelihood.dream_mask_draws(jax.random.key(2), 8, seq.size, PROMPT.size)
  masks_np = np.asarray(masks)
  assert not masks_np[:, :PROMPT.size].any() and not masks_np[:, -1].any()
  t = (np.asarray(p_mask) - 1e-3) / (1 - 1e-3)
  np.testing.assert_allclose(np.sort(np.diff(np.sort(t))), 1 / 8, atol=1e-5)  # antithetic spacing
  got = likelihood.dream_minibatch_nll(params("dream"), jnp.asarray(seq), masks, p_mask, config=DREAM,
                                       prompt_len=PROMPT.size, cfg_scale=cfg_scale)
  np.testing.assert_allclose(float(got), _dream_numpy_loss(seq, masks_np, np.asarray(p_mask), cfg_scale), rtol=1e-5)


def _subset_ce(config, seq, positions, shift):
  """Σ over `positions` of the CE when exactly those positions are masked."""
  noisy = seq.copy()
  noisy[list(positions)] = config.mask_token_id
  logits = np.asarray(_logits(params("llada" if not shift else "dream"), jnp.asarray(noisy[None]), config=config),
                      np.float64)[0]
  if shift:
    logits = np.concatenate([logits[:1], logits[:-1]])
  log_probs = _log_softmax(logits)
  return sum(-log_probs[j, seq[j]] for j in positions)


def test_llada_estimate_converges_to_exact_expectation():
  seq = np.concatenate([PROMPT, ANSWER])
  lp, t = PROMPT.size, ANSWER.size
  exact = 0.0
  for n in range(1, t + 1):
    subsets = list(itertools.combinations(range(lp, lp + t), n))
    exact += (1 / t) * (t / n) * np.mean([_subset_ce(LLADA, seq, s, shift=False) for s in subsets])
  losses = [float(likelihood.llada_minibatch_nll(params("llada"), jnp.asarray(seq),
                                                 likelihood.llada_mask_draws(key, 4, t), config=LLADA, prompt_len=lp))
            for key in jax.random.split(jax.random.key(3), 300)]
  error = 4 * np.std(losses) / np.sqrt(len(losses))
  assert abs(np.mean(losses) - exact) < error, (np.mean(losses), exact, error)
  estimate = likelihood.llada_log_likelihood(params("llada"), PROMPT, ANSWER, jax.random.key(4), config=LLADA,
                                             mc_num=64, batch_size=4)
  assert abs(estimate + exact) < 4 * np.std(losses) / np.sqrt(16)


def test_dream_estimate_converges_to_exact_expectation():
  seq = np.concatenate([PROMPT, ANSWER])
  lp, eps = PROMPT.size, 1e-3
  maskable = list(range(lp, seq.size - 1))  # the last position is never masked
  nodes, weights = np.polynomial.legendre.leggauss(16)
  ts, ws = (nodes + 1) / 2, weights / 2
  exact = 0.0
  for n in range(1, len(maskable) + 1):
    for subset in itertools.combinations(maskable, n):
      ce = _subset_ce(DREAM, seq, subset, shift=True)
      p = (1 - eps) * ts + eps
      exact += ce * np.sum(ws * p ** n * (1 - p) ** (len(maskable) - n) / p)
  losses = []
  for key in jax.random.split(jax.random.key(5), 200):
    masks, p_mask = likelihood.dream_mask_draws(key, 8, seq.size, lp, eps)
    losses.append(float(likelihood.dream_minibatch_nll(params("dream"), jnp.asarray(seq), masks, p_mask,
                                                       config=DREAM, prompt_len=lp)))
  error = 4 * np.std(losses) / np.sqrt(len(losses))
  assert abs(np.mean(losses) - exact) < error, (np.mean(losses), exact, error)
  estimate = likelihood.dream_log_likelihood(params("dream"), PROMPT, ANSWER, jax.random.key(6), config=DREAM,
                                             mc_num=64, batch_size=8)
  assert np.isfinite(estimate) and estimate < 0


def test_score_choices_and_errors():
  scores = likelihood.score_choices(params("llada"), PROMPT, [ANSWER, ANSWER[:2]], jax.random.key(0), config=LLADA,
                                    mc_num=8, batch_size=4)
  assert len(scores) == 2 and all(np.isfinite(scores))
  with pytest.raises(ValueError, match="multiple of batch_size"):
    likelihood.llada_log_likelihood(params("llada"), PROMPT, ANSWER, jax.random.key(0), config=LLADA, mc_num=10,
                                    batch_size=4)
  with pytest.raises(ValueError, match="mask token"):
    likelihood.llada_log_likelihood(params("llada"), PROMPT, ANSWER, jax.random.key(0), config=preset("tiny-llama"))
