"""Batched likelihood of many (context, continuation) requests: one compiled program per batch of pairs.

The estimators are those of `dlm_jax.analysis.likelihood` (same weighting, same CFG rules, LLaDA's torch-exact
count table), laid out for many requests at once:

- every request is one row [context | continuation], left-padded to a width S that depends only on its
  own length L (`row_width`: L rounded up to a multiple of 8 up to 128, of 16 up to 256, of 32 beyond, so
  padding stays under max(8, L/8) tokens); pad keys are hidden and positions shifted so that each row's first
  real token is at position 0, so padding does not change a request's result;
- a Monte-Carlo estimate is a set of (request, draw) pairs; a batch of `batch_size` pairs (the last one
  padded by repeating its last pair) is one jitted call that draws the masks, runs the model (twice
  with CFG) and returns each pair's loss Σ_masked CE / weight;
- draw d of a request uses the key fold_in(fold_in(request key, d // group), d % group + 1), where the
  request key is fold_in(key(seed), CRC-32 of the request's ids) and `group` is the stratum (LLaDA's
  and Dream's MC minibatch): the draws of one stratum share LLaDA's k, or Dream's u. So a request's
  estimate depends on the seed and its own ids only, not on the other requests of a batch or their order.
  A draw's position uniforms are the last S of uniform(draw key, [round_up(S, DRAW_MULTIPLE)]) (a vector
  of L rounded up to a multiple of 32), so they do not change with the row width.

LLaDA (stratified): in stratum g, k ~ U{1..T} from the stratum key; draw i masks exactly
n_i = `llada_mask_count_table(T, group)[k − 1, i]` continuation positions chosen uniformly (from the draw
key); weight n_i / T. Dream (antithetic): u ~ U(0, 1) from the stratum key, t_i = (u + i/group) mod 1,
p_i = (1 − ε)·t_i + ε; each continuation position is masked with probability p_i (draw key) except the
row's first real token and its last position; weight p_i. Both read predictions by the model's shift rule
(`dlm_jax.config.logit_shift`), whichever the estimator. The estimate of
log p(continuation | context) is −(Σ of the mc_num pair losses) / mc_num.

Autoregressive models: the exact teacher-forced log-likelihood Σ log p(x_j | x_<j) over the continuation
and whether every continuation token is the argmax (`teacher_forced`).
"""

from __future__ import annotations

import dataclasses
import functools
import zlib
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from dlm_jax.runtime import sharding
from dlm_jax.config import ModelConfig, logit_shift
from dlm_jax.instrument.interventions import padding_bias
from dlm_jax.analysis.likelihood import guided_logits, llada_mask_count_table, masked_ce
from dlm_jax.model import forward
from dlm_jax.sampling.padding import shifted_positions
from dlm_jax.model.forward_inputs import CallInstruments, Readout

ESTIMATORS = ("llada", "dream")
ROW_STEPS = ((128, 8), (256, 16))
ROW_STEP_BEYOND = 32
WINDOW_MULTIPLE = 8
DRAW_MULTIPLE = 32


@dataclasses.dataclass(frozen=True)
class MCSettings:
  """estimator: llada | dream; mc_num: draws per request; group: draws per stratum (mc_num must be a
  multiple); cfg_scale: guidance weight (0 = none; LLaDA's rule (w + 1), Dream's w); eps: Dream's ε."""

  estimator: str = "llada"
  mc_num: int = 128
  group: int = 32
  cfg_scale: float = 0.0
  eps: float = 1e-3

  def __post_init__(self):
    if self.estimator not in ESTIMATORS:
      raise ValueError(f"estimator={self.estimator}: expected one of {', '.join(ESTIMATORS)}")
    if self.mc_num < 1 or self.group < 1 or self.mc_num % self.group:
      raise ValueError(f"mc_num={self.mc_num}: expected a positive multiple of mc_batch={self.group}")
    if self.cfg_scale < 0:
      raise ValueError(f"cfg={self.cfg_scale}: expected >= 0 (0 = no guidance)")
    if not 0 < self.eps < 1:
      raise ValueError(f"eps={self.eps}: expected a value in (0, 1)")


def _round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def row_width(length: int) -> int:
  """S of a request of `length` tokens: rounded up to a multiple of 8 (length <= 128), 16 (<= 256) or 32,
  so padding stays under max(8, length/8) tokens and round_up(S, DRAW_MULTIPLE) = round_up(length, DRAW_MULTIPLE)."""
  step = next((step for bound, step in ROW_STEPS if length <= bound), ROW_STEP_BEYOND)
  return _round_up(length, step)


def shapes(context_len: int, continuation_len: int) -> tuple[int, int]:
  """(S, W) of a request: row width (`row_width`) and continuation window (a multiple of
  WINDOW_MULTIPLE, at most S − 1)."""
  width = row_width(context_len + continuation_len)
  return width, min(_round_up(continuation_len, WINDOW_MULTIPLE), width - 1)


def request_key_number(context: Sequence[int], continuation: Sequence[int]) -> int:
  """A 31-bit number of a request: the CRC-32 of its ids (int32, context, −1, continuation)."""
  ids = np.asarray(list(context) + [-1] + list(continuation), np.int32)
  return zlib.crc32(ids.tobytes()) & 0x7FFFFFFF


def _check_request(context, continuation, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
  context, continuation = np.asarray(context, np.int32).reshape(-1), np.asarray(continuation, np.int32).reshape(-1)
  if context.size == 0 or continuation.size == 0:
    raise ValueError("Every request needs at least one context token (e.g. BOS) and one continuation token.")
  ids = np.concatenate([context, continuation])
  if ids.min() < 0 or ids.max() >= vocab_size:
    raise ValueError(f"Token ids must lie in [0, {vocab_size}).")
  return context, continuation


def _pack(context: np.ndarray, continuation: np.ndarray, width: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
  """A left-padded row [S] int32 and its validity [S] bool."""
  ids = np.concatenate([context, continuation])
  row = np.full(width, pad_id, np.int32)
  row[width - ids.size:] = ids
  return row, np.arange(width) >= width - ids.size


def _layout(valid: jax.Array):
  return padding_bias(valid), shifted_positions(valid)


@functools.partial(jax.jit, static_argnames=("settings",))
def draw_masks(valid, target_len, key_data, draw_index, count_columns, *, settings: MCSettings):
  """The masks of a batch of pairs: valid [P, S] bool, target_len [P] int32 (T), key_data [P, 2] uint32
  (request keys, `jax.random.key_data`), draw_index [P] int32, count_columns [P, S] int32 (LLaDA: column
  d % group of the request's count table, zero-padded; unused by Dream). Returns (masked [P, S] bool,
  weight [P] float32)."""
  width = valid.shape[1]
  group = settings.group
  keys = jax.random.wrap_key_data(key_data)
  stratum_keys = jax.vmap(jax.random.fold_in)(keys, draw_index // group)
  draw_keys = jax.vmap(jax.random.fold_in)(stratum_keys, draw_index % group + 1)
  position = jnp.arange(width)[None, :]
  target = position >= width - target_len[:, None]
  padded_width = _round_up(width, DRAW_MULTIPLE)
  uniform = jax.vmap(lambda key: jax.random.uniform(key, (padded_width,)))(draw_keys)[:, padded_width - width:]
  if settings.estimator == "llada":
    k = jax.vmap(lambda key, t: jax.random.randint(key, (), 1, t + 1))(stratum_keys, target_len)
    counts = jnp.take_along_axis(count_columns, (k - 1)[:, None], axis=1)[:, 0]
    ranks = jnp.argsort(jnp.argsort(jnp.where(target, uniform, 2.0), axis=-1), axis=-1)
    return target & (ranks < counts[:, None]), counts.astype(jnp.float32) / target_len.astype(jnp.float32)
  u = jax.vmap(lambda key: jax.random.uniform(key, (), jnp.float32))(stratum_keys)
  t = jnp.remainder(u + (draw_index % group).astype(jnp.float32) / group, 1.0)
  p_mask = jnp.float32(1 - settings.eps) * t + jnp.float32(settings.eps)
  first = jnp.argmax(valid, axis=1)[:, None]
  allowed = target & (position != width - 1) & (position != first)
  return allowed & (uniform < p_mask[:, None]), p_mask


@functools.partial(jax.jit, static_argnames=("config", "settings", "window"))
def pair_losses(params, tokens, valid, target_len, key_data, draw_index, count_columns, *, config: ModelConfig,
                settings: MCSettings, window: int) -> jax.Array:
  """Σ over masked continuation positions of CE / weight for every pair: tokens [P, S] int32 (clean rows),
  other inputs as `draw_masks`; window W: the continuation span read (>= every T, < S). Returns [P]."""
  width = tokens.shape[1]
  masked, weight = draw_masks(valid, target_len, key_data, draw_index, count_columns, settings=settings)
  noisy = jnp.where(masked, config.mask_token_id, tokens)
  target = jnp.arange(width)[None, :] >= width - target_len[:, None]
  bias, positions = _layout(valid)
  llada = settings.estimator == "llada"
  outputs = guided_logits(params, noisy, valid & ~target, config=config,
                          window=logit_shift.output_window(width - window, width, config.logit_shift),
                          mask_id=config.mask_token_id, cfg_scale=settings.cfg_scale, llada_rule=llada, bias=bias,
                          positions=positions)
  logits = logit_shift.target_logits(outputs, width - window, config.logit_shift)
  return masked_ce(logits, tokens[:, width - window:], masked[:, width - window:], weight)


@functools.partial(jax.jit, static_argnames=("config", "window"))
def teacher_forced(params, tokens, valid, target_len, *, config: ModelConfig, window: int):
  """Exact log p(continuation | context) of a causal model and whether it is greedy: tokens / valid
  [P, S], target_len [P]; window W as `pair_losses`. Returns (log-likelihood [P] float32, greedy [P] bool)."""
  width = tokens.shape[1]
  bias, positions = _layout(valid)
  logits = forward(params, tokens, config=config, instruments=CallInstruments(bias=bias),
                   readout=Readout(window=logit_shift.output_window(width - window, width,
                                                                    config.logit_shift)), positions=positions,
                   ).logits
  log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  targets = tokens[:, width - window:]
  scored = jnp.arange(width - window, width)[None, :] >= width - target_len[:, None]
  token_lp = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
  greedy = jnp.all(jnp.where(scored, jnp.argmax(log_probs, axis=-1) == targets, True), axis=-1)
  return jnp.sum(jnp.where(scored, token_lp, 0.0), axis=-1), greedy


def _place(arrays, mesh: Mesh | None):
  if mesh is None:
    return [jnp.asarray(a) for a in arrays]
  return [sharding.put_rows(a, mesh) for a in arrays]


def _buckets(requests, config: ModelConfig):
  """{(S, W): [request index]} after checking every request."""
  buckets: dict[tuple[int, int], list[int]] = {}
  for index, (context, continuation) in enumerate(requests):
    context, continuation = _check_request(context, continuation, config.vocab_size)
    buckets.setdefault(shapes(context.size, continuation.size), []).append(index)
  return buckets


def _pad_id(config: ModelConfig) -> int:
  return config.pad_token_id if config.pad_token_id is not None else (config.eos_token_id or 0)


def mc_log_likelihoods(params, requests: Sequence[tuple[Sequence[int], Sequence[int]]], *, config: ModelConfig,
                       settings: MCSettings, seed: int = 0, batch_size: int = 32, mesh: Mesh | None = None) -> np.ndarray:
  """Monte-Carlo estimates of log p(continuation | context) of a masked diffusion model (module docstring):
  requests: (context ids, continuation ids) pairs. Returns [R] float64. batch_size: pairs per call (a
  multiple of the mesh's batch shards under `mesh`)."""
  if config.mask_token_id is None:
    raise ValueError(f"Likelihood estimation needs a mask token id; config {config.name!r} has none.")
  if batch_size < 1:
    raise ValueError(f"batch_size={batch_size}: expected a positive number of (request, draw) pairs")
  if mesh is not None:
    sharding.check_batch(batch_size, mesh)
  totals = np.zeros(len(requests), np.float64)
  program = dataclasses.replace(settings, mc_num=settings.group)  # mc_num does not change the program
  for (width, window), members in sorted(_buckets(requests, config).items()):
    rows, valids, lengths, keys, columns = {}, {}, {}, {}, {}
    for r in members:
      context, continuation = (np.asarray(x, np.int32).reshape(-1) for x in requests[r])
      rows[r], valids[r] = _pack(context, continuation, width, _pad_id(config))
      lengths[r] = continuation.size
      keys[r] = np.asarray(jax.random.key_data(jax.random.fold_in(
          jax.random.key(seed), request_key_number(context, continuation))))
      table = np.zeros((width, settings.group), np.int32)
      if settings.estimator == "llada":
        table[:continuation.size] = llada_mask_count_table(continuation.size, settings.group)
      columns[r] = table
    pairs = [(r, d) for r in members for d in range(settings.mc_num)]
    for start in range(0, len(pairs), batch_size):
      chunk = pairs[start:start + batch_size]
      chunk = chunk + [chunk[-1]] * (batch_size - len(chunk))
      inputs = _place([np.stack([rows[r] for r, _ in chunk]), np.stack([valids[r] for r, _ in chunk]),
                       np.asarray([lengths[r] for r, _ in chunk], np.int32), np.stack([keys[r] for r, _ in chunk]),
                       np.asarray([d for _, d in chunk], np.int32),
                       np.stack([columns[r][:, d % settings.group] for r, d in chunk])], mesh)
      losses = np.asarray(pair_losses(params, *inputs, config=config, settings=program, window=window),
                          np.float64)
      for (r, _), loss in zip(pairs[start:start + batch_size], losses):
        totals[r] += loss
  return -totals / settings.mc_num


def ar_log_likelihoods(params, requests: Sequence[tuple[Sequence[int], Sequence[int]]], *, config: ModelConfig,
                       batch_size: int = 32, mesh: Mesh | None = None) -> tuple[np.ndarray, np.ndarray]:
  """Exact log p(continuation | context) of a causal model and greedy flags: ([R] float64, [R] bool)."""
  if not config.causal:
    raise ValueError(f"Teacher forcing needs a causal model; config {config.name!r} is bidirectional.")
  if mesh is not None:
    sharding.check_batch(batch_size, mesh)
  scores, greedy = np.zeros(len(requests), np.float64), np.zeros(len(requests), bool)
  for (width, window), members in sorted(_buckets(requests, config).items()):
    for start in range(0, len(members), batch_size):
      chunk = members[start:start + batch_size]
      padded = chunk + [chunk[-1]] * (batch_size - len(chunk))
      packed = [_pack(*(np.asarray(x, np.int32).reshape(-1) for x in requests[r]), width, _pad_id(config))
                for r in padded]
      lengths = np.asarray([np.asarray(requests[r][1]).size for r in padded], np.int32)
      tokens, valid, lengths = _place([np.stack([p[0] for p in packed]), np.stack([p[1] for p in packed]), lengths],
                                      mesh)
      lp, gr = teacher_forced(params, tokens, valid, lengths, config=config, window=window)
      scores[chunk] = np.asarray(lp, np.float64)[:len(chunk)]
      greedy[chunk] = np.asarray(gr)[:len(chunk)]
  return scores, greedy
