"""Monte-Carlo log-likelihood of an answer given a prompt, for multiple-choice scoring.

A masked diffusion model has no exact likelihood; both estimators below average, over random maskings of
the answer, Σ over masked answer positions of the cross-entropy divided by the masking ratio (an upper
bound of the NLL, `reference/models.md` §2.9, §3.9, `reference/peers.md` §5.2). They return the
*log-likelihood* estimate, i.e. minus the official NLL estimate.

LLaDA (stratified, `get_log_likelihood`): each minibatch holds b copies of [prompt | answer] (answer
length T). k is uniform in {1..T}; row i masks exactly n_i answer positions,
n_i = round(torch.linspace(k, k + (b−1)·T/b, b))_i wrapped into [1, T] (float32 torch arithmetic, computed
here exactly as a table over k), chosen uniformly at random; the prompt is never masked.
Minibatch loss = Σ_i Σ_masked CE / (n_i / T) / b. CFG: logits = un + (w + 1)·(cond − un) with the
prompt replaced by mask tokens in the unconditional copy.

Dream (antithetic, `eval/eval.py` "ftb"): t_i = (u + i/b) mod 1 with one u ~ U(0, 1) per minibatch,
p_i = (1 − ε)·t_i + ε, every answer position masked independently with probability p_i except the first
and the last position of the whole sequence; minibatch loss = Σ_i Σ_masked CE / p_i / b.
CFG: logits = un + w·(cond − un) (applied when cfg_scale > 0; the prompt is masked in the unconditional copy).

Both read the prediction of a position by the model's own shift rule (`dlm_jax.config.logit_shift`: from the
output at that position for LLaDA-style models, at the one before for Dream's), whichever estimator is
used. (Before, the Dream estimator always shifted and LLaDA's never did, so an estimator used on the other
kind of model scored the neighbour's prediction.) Both run mc_num // batch_size minibatches (at least one
for Dream), each one jitted call with explicit PRNG keys. The mask draws are separate functions so that tests can replay them.

Under a `mesh` (params already placed, e.g. by `sharding.param_shardings`), each minibatch's b noisy copies
are sharded over the batch axes (b must divide over data × fsdp) and the sequence is replicated; the
estimate equals the single-device one up to float32 reduction order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from dlm_jax.runtime import sharding
from dlm_jax.config import ModelConfig, logit_shift
from dlm_jax.core.attention_bias import NO_BIAS
from dlm_jax.model import forward
from dlm_jax.sampling.schedules import torch_linspace_f32
from dlm_jax.model.forward_inputs import CallInstruments, Readout


@functools.lru_cache(maxsize=64)
def llada_mask_count_table(target_len: int, batch_size: int) -> np.ndarray:
  """[T, b] int32: row k−1 holds the masked counts n_i of the b rows when the draw is k (1..T)."""
  t, b = target_len, batch_size
  offset = np.float32((b - 1) * (t / b))
  table = np.zeros((t, b), np.int32)
  for k in range(1, t + 1):
    end = np.float32(np.float32(k) + offset)
    values = torch_linspace_f32(float(k), float(end), b)
    counts = np.round(values).astype(np.int64)
    table[k - 1] = ((counts - 1) % t) + 1
  return table


def llada_mask_draws(key: jax.Array, batch_size: int, target_len: int) -> jax.Array:
  """One LLaDA minibatch of answer masks: [b, T] bool, row i masking exactly n_i random positions."""
  k_key, perm_key = jax.random.split(key)
  k = jax.random.randint(k_key, (), 1, target_len + 1)
  counts = jnp.asarray(llada_mask_count_table(target_len, batch_size))[k - 1]
  scores = jax.random.uniform(perm_key, (batch_size, target_len))
  ranks = jnp.argsort(jnp.argsort(scores, axis=-1), axis=-1)
  return ranks < counts[:, None]


def dream_mask_draws(key: jax.Array, batch_size: int, seq_len: int, prompt_len: int, eps: float = 1e-3):
  """One Dream minibatch: (masks [b, S] bool over the answer only, p_mask [b] float32)."""
  u_key, mask_key = jax.random.split(key)
  u = jax.random.uniform(u_key, (), jnp.float32)
  t = jnp.remainder(u + jnp.arange(batch_size, dtype=jnp.float32) / batch_size, 1.0)
  p_mask = jnp.float32(1 - eps) * t + jnp.float32(eps)
  masks = jax.random.uniform(mask_key, (batch_size, seq_len)) < p_mask[:, None]
  position = jnp.arange(seq_len)
  allowed = (position >= prompt_len) & (position != 0) & (position != seq_len - 1)
  return masks & allowed[None, :], p_mask


def masked_ce(logits: jax.Array, targets: jax.Array, masked: jax.Array, weight: jax.Array) -> jax.Array:
  """Σ over masked positions of CE / weight, per row: logits [b, T, V], targets/masked [b, T] -> [b]."""
  log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  ce = -jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
  return jnp.sum(jnp.where(masked, ce / weight[:, None], 0.0), axis=-1)


def guided_logits(params, noisy, prompt, *, config, window, mask_id, cfg_scale, llada_rule, bias=NO_BIAS,
            positions=None):
  """Logits of the window [b, W, V], with CFG when cfg_scale > 0: noisy [b, S] ids, prompt [b|1, S] bool
  (the positions the unconditional copy masks); bias / positions: the call's padding layout (rows [b])."""
  if cfg_scale <= 0:
    return forward(params, noisy, config=config, readout=Readout(window=window),
                   instruments=CallInstruments(bias=bias), positions=positions).logits
  uncond = jnp.where(prompt, mask_id, noisy)
  twice = lambda array: None if array is None else jnp.concatenate([array, array])
  bias = jax.tree.map(lambda leaf: jnp.concatenate([leaf, leaf]) if leaf.shape[0] > 1 else leaf, bias)
  logits = forward(params, jnp.concatenate([noisy, uncond]), config=config, readout=Readout(window=window),
                   instruments=CallInstruments(bias=bias), positions=twice(positions)).logits
  cond, un = logits[:noisy.shape[0]], logits[noisy.shape[0]:]
  return un + ((cfg_scale + 1.0) if llada_rule else cfg_scale) * (cond - un)


def _prompt_positions(length: int, prompt_len: int) -> jax.Array:
  """[1, S] bool: the first prompt_len positions."""
  return jnp.arange(length)[None, :] < prompt_len


@functools.partial(jax.jit, static_argnames=("config", "prompt_len", "cfg_scale"))
def llada_minibatch_nll(params, seq, answer_masks, *, config: ModelConfig, prompt_len: int,
                        cfg_scale: float = 0.0) -> jax.Array:
  """LLaDA's loss of one minibatch: seq [L] int (prompt + answer), answer_masks [b, T] bool -> scalar."""
  b, t = answer_masks.shape
  mask_id = config.mask_token_id
  rows = jnp.broadcast_to(seq[None, :], (b, seq.shape[0]))
  noisy = rows.at[:, prompt_len:].set(jnp.where(answer_masks, mask_id, rows[:, prompt_len:]))
  shift = config.logit_shift
  outputs = guided_logits(params, noisy, _prompt_positions(seq.shape[0], prompt_len), config=config,
                          window=logit_shift.output_window(prompt_len, seq.shape[0], shift), mask_id=mask_id,
                          cfg_scale=cfg_scale, llada_rule=True)
  logits = logit_shift.target_logits(outputs, prompt_len, shift)
  masked = noisy[:, prompt_len:] == mask_id
  ratio = jnp.sum(answer_masks, axis=-1).astype(jnp.float32) / t
  return jnp.sum(masked_ce(logits, rows[:, prompt_len:], masked, ratio)) / b


@functools.partial(jax.jit, static_argnames=("config", "prompt_len", "cfg_scale"))
def dream_minibatch_nll(params, seq, masks, p_mask, *, config: ModelConfig, prompt_len: int,
                        cfg_scale: float = 0.0) -> jax.Array:
  """Dream's loss of one minibatch: seq [L], masks [b, L] bool, p_mask [b] float32 -> scalar."""
  b, length = masks.shape
  mask_id = config.mask_token_id
  rows = jnp.broadcast_to(seq[None, :], (b, length))
  noisy = jnp.where(masks, mask_id, rows)
  start, shift = max(prompt_len, 0), config.logit_shift
  outputs = guided_logits(params, noisy, _prompt_positions(length, prompt_len), config=config,
                          window=logit_shift.output_window(start, length, shift), mask_id=mask_id,
                          cfg_scale=cfg_scale, llada_rule=False)
  logits = logit_shift.target_logits(outputs, start, shift)
  masked = noisy[:, start:] == mask_id
  return jnp.sum(masked_ce(logits, rows[:, start:], masked, p_mask)) / b


def _placer(mesh: Mesh | None, batch_size: int):
  """A function placing (host or device) arrays: rows sharded over the batch axes (`rows=True`) or
  replicated on `mesh`; identity without a mesh."""
  if mesh is None:
    return lambda array, rows=False: array
  sharding.check_batch(batch_size, mesh)

  def place(array, rows=False):
    return sharding.put_rows(array, mesh) if rows else sharding.put_host(array, sharding.replicated(mesh))

  return place


def _check(config: ModelConfig, prompt, answer, mc_num: int, batch_size: int):
  if config.mask_token_id is None:
    raise ValueError(f"Likelihood estimation needs a mask token id; config {config.name!r} has none.")
  prompt, answer = np.asarray(prompt, np.int32).reshape(-1), np.asarray(answer, np.int32).reshape(-1)
  if answer.size == 0:
    raise ValueError("The answer must hold at least one token.")
  if mc_num < 1 or batch_size < 1:
    raise ValueError(f"mc_num and batch_size must be >= 1, got {mc_num}, {batch_size}.")
  return prompt, answer


def llada_log_likelihood(params, prompt, answer, key: jax.Array, *, config: ModelConfig, mc_num: int = 128,
                         batch_size: int = 16, cfg_scale: float = 0.0, mesh: Mesh | None = None) -> float:
  """LLaDA's stratified Monte-Carlo estimate of log p(answer | prompt) (module docstring).

  prompt: [Lp] ids, answer: [T] ids. mc_num // batch_size minibatches (mc_num must be a multiple of
  batch_size, as in the original). Returns −mean minibatch loss. mesh: see the module docstring.
  """
  prompt, answer = _check(config, prompt, answer, mc_num, batch_size)
  if mc_num % batch_size:
    raise ValueError(f"mc_num ({mc_num}) must be a multiple of batch_size ({batch_size}).")
  place = _placer(mesh, batch_size)
  seq = place(np.concatenate([prompt, answer]))
  losses = []
  for draw_key in jax.random.split(key, mc_num // batch_size):
    masks = place(llada_mask_draws(draw_key, batch_size, answer.size), rows=True)
    losses.append(llada_minibatch_nll(params, seq, masks, config=config, prompt_len=int(prompt.size),
                                      cfg_scale=float(cfg_scale)))
  return -float(np.mean([float(loss) for loss in losses]))


def dream_log_likelihood(params, prompt, answer, key: jax.Array, *, config: ModelConfig, mc_num: int = 128,
                         batch_size: int = 32, cfg_scale: float = 0.0, eps: float = 1e-3,
                         mesh: Mesh | None = None) -> float:
  """Dream's antithetic Monte-Carlo estimate of log p(answer | prompt) (module docstring).

  prompt: [Lp] ids, answer: [T] ids. max(mc_num // batch_size, 1) minibatches. Returns −mean loss.
  mesh: see the module docstring.
  """
  prompt, answer = _check(config, prompt, answer, mc_num, batch_size)
  place = _placer(mesh, batch_size)
  seq = np.concatenate([prompt, answer])
  losses = []
  for draw_key in jax.random.split(key, max(mc_num // batch_size, 1)):
    masks, p_mask = dream_mask_draws(draw_key, batch_size, int(seq.shape[0]), int(prompt.size), eps)
    losses.append(dream_minibatch_nll(params, place(seq), place(masks, rows=True), place(p_mask, rows=True),
                                      config=config, prompt_len=int(prompt.size),
                                      cfg_scale=float(cfg_scale)))
  return -float(np.mean([float(loss) for loss in losses]))


def score_choices(params, prompt, choices, key: jax.Array, *, config: ModelConfig, family: str = "llada",
                  **kwargs) -> list[float]:
  """Log-likelihood estimates of every choice [T_c] ids after `prompt` (same key for each choice).

  family: "llada" (also MMaDA) or "dream"; kwargs go to the estimator."""
  estimator = {"llada": llada_log_likelihood, "dream": dream_log_likelihood}[family]
  return [estimator(params, prompt, choice, key, config=config, **kwargs) for choice in choices]
