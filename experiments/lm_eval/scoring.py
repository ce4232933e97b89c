"""`loglikelihood` and `loglikelihood_rolling` of the `dlm_jax` model.

Causal models: the exact teacher-forced log-likelihood and lm-eval's greedy flag
(`dlm_jax.analysis.likelihood_batch.ar_log_likelihoods`). Masked diffusion models: the Monte-Carlo estimate of
`dlm_jax.analysis.likelihood_batch.mc_log_likelihoods` with the task's settings (estimator, mc_num, mc_batch, cfg,
eps, seed); every request with the same settings goes through the same batches of (request, draw) pairs.
The greedy flag of a DLM is False unless is_check_greedy=True: then the continuation is decoded from the
context with the model's sampler at temperature 0, one token per step (gen_length = steps = block_length
= its length; LLaDA's `suffix_greedy_prediction` picks the most confident position each step the same
way) and compared with it.

loglikelihood_rolling splits a text into lm-eval's disjoint rolling windows of max_length tokens after the
prefix token (BOS, else EOS); causal models sum the exact window log-likelihoods; diffusion models sum the
windows' Monte-Carlo ELBO estimates — a lower bound of log p in expectation, not log p (logged once).
"""

from __future__ import annotations

import logging

import numpy as np

from dlm_jax.analysis import likelihood_batch
from dlm_jax.session import decode_settings
from dlm_jax.session.decode_settings import DecodeSettings
from experiments.common.cli import UserError
from experiments.lm_eval import generation

LOG = logging.getLogger(__name__)


def mc_settings(lm, args) -> likelihood_batch.MCSettings:
  """The estimator settings of a task's args (estimator auto: dream for shifted models)."""
  estimator = args.estimator
  if estimator == "auto":
    estimator = "dream" if lm.model.config.logit_shift == 1 else "llada"
  try:
    return likelihood_batch.MCSettings(estimator, args.mc_num, min(args.mc_batch, args.mc_num), args.cfg, args.eps)
  except ValueError as e:
    raise UserError(f"model_args {e}") from None


def _check_model(lm) -> None:
  model = lm.model
  if not model.decoder.likelihood:
    raise UserError(f"loglikelihood: {model.label} decodes with {model.sampler}; its likelihood is not estimated "
                    "here (masked diffusion and causal models only)")
  if model.sink_token != "none":
    raise UserError(f"loglikelihood: {model.label} was trained with an extra sink token, which the likelihood "
                    "estimators do not apply; pass sink_token=none to score it without")
  if lm.args.mask_sinks:
    LOG.warning("dlm_jax: mask_sinks applies to generation only; likelihoods are computed unmasked")
  if lm.args.steer:
    LOG.warning("dlm_jax: steer applies to generation only; likelihoods are computed unsteered")


def _greedy(lm, args, pairs: list[tuple[list[int], list[int]]]) -> list[bool]:
  """is_check_greedy for a DLM: decode each continuation's length at temperature 0 and compare."""
  flags = [False] * len(pairs)
  by_length: dict[int, list[int]] = {}
  for index, (_, continuation) in enumerate(pairs):
    by_length.setdefault(len(continuation), []).append(index)
  for length, members in by_length.items():
    settings = DecodeSettings(gen_length=length, steps=length, block_length=length, temperature=0.0,
                              cfg_scale=args.cfg, alg=args.alg, padding="invariant", seed=args.seed)
    values = decode_settings.model_settings(settings, lm.model)
    for start in range(0, len(members), args.batch_size):
      chunk = members[start:start + args.batch_size]
      rows = generation.run_batch(lm.model, values, [pairs[i][0] for i in chunk], [str(pairs[i]) for i in chunk],
                                  args, lm.runtime, lm.numerics)
      for i, row in zip(chunk, rows):
        flags[i] = row == list(pairs[i][1])
  return flags


def score_pairs(lm, pairs: list[tuple[list[int], list[int]]], tasks: list[str | None]) -> list[tuple[float, bool]]:
  """(log-likelihood, greedy) of every (context ids, continuation ids) pair, each with its task's settings."""
  _check_model(lm)
  model = lm.model
  if not model.diffusion:
    scores, greedy = likelihood_batch.ar_log_likelihoods(model.params, pairs, config=model.config,
                                                         batch_size=lm.runtime.round_batch(lm.args.batch_size),
                                                         mesh=lm.runtime.mesh)
    return [(float(s), bool(g)) for s, g in zip(scores, greedy)]
  groups: dict[tuple, list[int]] = {}
  for index, task in enumerate(tasks):
    args = lm.args.for_task(task)
    groups.setdefault((mc_settings(lm, args), args), []).append(index)
  results: list[tuple[float, bool] | None] = [None] * len(pairs)
  for (settings, args), members in groups.items():
    scores = likelihood_batch.mc_log_likelihoods(model.params, [pairs[i] for i in members], config=model.config,
                                                 settings=settings, seed=args.seed,
                                                 batch_size=lm.runtime.round_batch(args.pairs_per_call),
                                                 mesh=lm.runtime.mesh)
    greedy = (_greedy(lm, args, [pairs[i] for i in members]) if args.is_check_greedy
              else [False] * len(members))
    for i, score, flag in zip(members, scores, greedy):
      results[i] = (float(score), bool(flag))
  return results


def loglikelihood(lm, requests) -> list[tuple[float, bool]]:
  """lm-eval's loglikelihood over Instances with args (context, continuation)."""
  pairs = [lm.encode_pair(*request.args) for request in requests]
  results = score_pairs(lm, pairs, [request.task_name for request in requests])
  for request, result in zip(requests, results):
    lm.cache_hook.add_partial("loglikelihood", request.args, result)
  return results


def rolling_windows(lm, text: str) -> list[tuple[list[int], list[int]]]:
  """lm-eval's disjoint rolling windows of the text's ids (prefix token first)."""
  from lm_eval import utils  # pylint: disable=import-outside-toplevel
  config = lm.model.config
  prefix = config.bos_token_id if config.bos_token_id is not None else config.eos_token_id
  ids = lm.model.tokenizer.encode(text)
  windows = utils.get_rolling_token_windows(token_list=ids, prefix_token=prefix, max_seq_len=lm.args.max_length,
                                            context_len=1)
  return [utils.make_disjoint_window(w) for w in windows]


def loglikelihood_rolling(lm, requests) -> list[float]:
  """lm-eval's loglikelihood_rolling over Instances with args (text,): see the module docstring."""
  if lm.model.diffusion and not lm.warned_rolling:
    LOG.warning("dlm_jax: loglikelihood_rolling of a diffusion model returns the Monte-Carlo ELBO estimate, a "
                "lower bound of log p (word/byte perplexities are upper bounds)")
    lm.warned_rolling = True
  windows, owners, tasks = [], [], []
  for index, request in enumerate(requests):
    for window in rolling_windows(lm, request.args[0]):
      windows.append(window)
      owners.append(index)
      tasks.append(request.task_name)
  totals = np.zeros(len(requests), np.float64)
  if windows:
    for owner, (score, _) in zip(owners, score_pairs(lm, windows, tasks)):
      totals[owner] += score
  results = [float(t) for t in totals]
  for request, result in zip(requests, results):
    lm.cache_hook.add_partial("loglikelihood_rolling", request.args, result)
  return results

