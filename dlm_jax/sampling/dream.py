"""Dream's `diffusion_generate` as one compiled program (`reference/models.md` §3.5–3.8).

The canvas is [B, Lp + G]: the left-padded prompt, then G mask tokens. `timesteps` are
`torch.linspace(1, eps, steps + 1)` in float32, bit for bit (`schedules.dream_timesteps`). Step i, with
t = ts[i] and s = ts[i + 1]:

  1. logits, shifted by one position: the prediction for position p is the model output at p − 1
     (position 0 reuses its own output); only the outputs needed for the masked region are computed;
  2. `sample_tokens`: divide by the temperature (if > 0), top-p then top-k filtering (removed logits become
     finfo(float32).min), probs = softmax; x0 ~ probs (temperature > 0) or argmax, with confidence p(x0);
     `topk_margin`: confidence = top1 − top2 probability; `entropy`: confidence = Σ p·log(p + 1e-10);
  3. `origin`: each masked position is revealed independently with probability 1 − s/t (1 at the last
     step) and takes its sample;
     other algs: k = int(M̄·(1 − s/t)) (int(M̄) at the last step) with M̄ = masked count of the batch / B in
     float32, the same k for every row (it may be 0); the k most confident positions of each row
     (confidence −inf where not masked; ties, routine at temperature 0: lowest index first) — or, with
     alg_temp > 0, k positions drawn without replacement from softmax(confidence / alg_temp) (Gumbel
     top-k) — take x0. As in the original, a chosen position that was not masked (only when k exceeds a
     row's masked count) is set to the mask token.

Left padding (`prompt_mask` given; `dlm_jax.sampling.padding`): positions are cumsum(mask) − 1 with pads
at 1, and the attention mask is the boolean outer product mask(i) ∧ mask(j) (pad queries see nothing:
finite uniform rows).
Without a prompt mask the model is fully bidirectional with positions 0..S−1, as the original's "full".

The original's `generation_tokens_hook_func` / `generation_logits_hook_func` are not offered; attention-side
changes go through interventions.

Precision: logits, softmax and confidences are float32 (the original computes them in the model dtype,
bf16 for the released weights); compare at temperature 0 in float32.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dlm_jax.config import ModelConfig
from dlm_jax.sampling import driver, keys, padding
from dlm_jax.sampling.schedules import dream_transfer_count, dream_transfer_fractions
from dlm_jax.sampling.selection import filter_top_k, filter_top_p, select_top_k, update_decode_step

Alg = Literal["origin", "maskgit_plus", "topk_margin", "entropy"]


@dataclasses.dataclass(frozen=True)
class DreamOptions:
  """Static knobs of Dream's `diffusion_generate` (defaults of its generation_config, models.md §3.2).

  Attributes:
    gen_length: G = max_new_tokens.
    steps: denoising steps (the loop always runs exactly this many).
    eps: last timestep.
    alg: "origin", "maskgit_plus", "topk_margin" or "entropy".
    alg_temp: None or 0 for deterministic top-k positions, > 0 to sample positions.
    temperature: 0 for argmax tokens, > 0 to sample.
    top_p: nucleus filtering (None or >= 1 = off).
    top_k: top-k filtering (None = off).
    mask_token_id: override of the config's mask id.
  """

  gen_length: int = 512
  steps: int = 512
  eps: float = 1e-3
  alg: Alg = "origin"
  alg_temp: float | None = None
  temperature: float = 0.0
  top_p: float | None = None
  top_k: int | None = None
  mask_token_id: int | None = None

  def __post_init__(self):
    if not isinstance(self.gen_length, int) or self.gen_length <= 0:
      raise ValueError(f"gen_length must be a positive integer, got {self.gen_length!r}.")
    if not isinstance(self.steps, int) or self.steps <= 0:
      raise ValueError(f"steps must be a positive integer, got {self.steps!r}.")
    if self.alg not in ("origin", "maskgit_plus", "topk_margin", "entropy"):
      raise ValueError(f"alg must be origin, maskgit_plus, topk_margin or entropy, got {self.alg!r}.")
    if self.temperature < 0:
      raise ValueError(f"temperature must be >= 0, got {self.temperature}.")
    if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k <= 0):
      raise ValueError(f"top_k must be None or a positive integer, got {self.top_k!r}.")
    if self.top_p is not None and self.top_p <= 0:
      raise ValueError(f"top_p must be None or > 0, got {self.top_p!r}.")
    if self.alg_temp is not None and self.alg_temp < 0:
      raise ValueError(f"alg_temp must be None or >= 0, got {self.alg_temp!r}.")


def sample_tokens(logits: jax.Array, key: jax.Array, *, temperature: float, top_p: float | None,
                  top_k: int | None, margin: bool = False, neg_entropy: bool = False, per_row: bool = False):
  """Dream's `sample_tokens`: logits [..., V] -> (confidence [...] float32, x0 [...] int32).
  per_row: `key` is [B] keys for logits [B, ..., V]."""
  logits = logits.astype(jnp.float32)
  if temperature > 0:
    logits = logits / temperature
  if top_p is not None and top_p < 1:
    logits = filter_top_p(logits, top_p)
  if top_k is not None:
    logits = filter_top_k(logits, top_k)
  probs = jax.nn.softmax(logits, axis=-1)
  if temperature > 0:
    x0 = keys.categorical(key, logits, per_row).astype(jnp.int32)
    confidence = jnp.take_along_axis(probs, x0[..., None], axis=-1)[..., 0]
  else:
    x0 = jnp.argmax(probs, axis=-1).astype(jnp.int32)
    confidence = jnp.max(probs, axis=-1)
  if margin:
    top2 = jax.lax.top_k(probs, 2)[0]
    confidence = top2[..., 0] - top2[..., 1]
  if neg_entropy:
    confidence = jnp.sum(probs * jnp.log(probs + 1e-10), axis=-1)
  return confidence, x0


def shift_logits(outputs: jax.Array, target_start: int) -> jax.Array:
  """Dream's one-position shift restricted to targets [target_start, S).

  outputs: [B, W, V], the model outputs of positions [max(target_start − 1, 0), S − 1).
  Returns [B, S − target_start, V]: row p holds the output of position p − 1 (position 0: its own).
  """
  if target_start >= 1:
    return outputs
  return jnp.concatenate([outputs[:, :1], outputs], axis=1)


@struct.dataclass
class DreamCarry:
  """tokens [B, S]; key; decode_step [B, G]."""

  tokens: jax.Array
  key: jax.Array
  decode_step: jax.Array


@dataclasses.dataclass(frozen=True)
class DreamFamily(driver.MaskedDiffusionFamily):
  """Dream's `diffusion_generate` (module docstring). infill: the prompt holds mask tokens, so the
  logits of the whole canvas are needed (else those of the generation region only)."""

  infill: bool

  name = "dream"
  min_prompt_length = 1
  padding_attention = "outer"
  shift_positions = True

  def check(self, config: ModelConfig) -> None:
    if config.logit_shift != 1:
      raise ValueError(f"Dream sampling reads shifted logits; config {config.name!r} has logit_shift=0 "
                       "(use dlm_jax.sampling.llada for unshifted models).")

  def init_carry(self, run, params, canvas, key, consts) -> DreamCarry:
    b = canvas.shape[0]
    return DreamCarry(tokens=canvas, key=key, decode_step=jnp.full((b, self.options.gen_length), -1, jnp.int32))

  def step(self, run, params, consts: padding.PaddingLayout, carry: DreamCarry, istate, i, phase):
    o, mask_id, lp = self.options, self.mask_id, run.prompt_length
    w0 = 0 if self.infill else lp
    x = carry.tokens
    key, sample_key, select_key = keys.split(carry.key, 3, run.row_keys)
    result = run.caller(params, x, i, istate, window=(max(w0 - 1, 0), run.total_length - 1),
                        positions=consts.positions, valid_keys=consts.valid, query_valid=consts.valid,
                        base_bias=consts.bias)
    logits = shift_logits(result.logits, w0)
    x_win = x[:, w0:]
    masked = x_win == mask_id
    fraction = jnp.asarray(dream_transfer_fractions(o.steps, o.eps))[i]
    sample = functools.partial(sample_tokens, temperature=o.temperature, top_p=o.top_p, top_k=o.top_k,
                               margin=o.alg == "topk_margin", neg_entropy=o.alg == "entropy", per_row=run.row_keys)
    confidence, x0 = sample(logits, sample_key)
    if o.alg == "origin":
      reveal = keys.uniform(select_key, masked.shape, jnp.float32, 0.0, 1.0, run.row_keys) < fraction
      x_win = jnp.where(masked & reveal, x0, x_win)
    else:
      k = dream_transfer_count(jnp.sum(masked), x.shape[0], fraction, i == o.steps - 1)
      full_confidence = jnp.where(masked, confidence, -jnp.inf)
      if o.alg_temp:
        gumbel = keys.gumbel(select_key, full_confidence.shape, jnp.float32, run.row_keys)
        full_confidence = jax.nn.log_softmax(full_confidence / o.alg_temp, axis=-1) + gumbel
      chosen = select_top_k(full_confidence, k)
      x_win = jnp.where(chosen, jnp.where(masked, x0, mask_id), x_win)
    new_x = x.at[:, w0:].set(x_win)
    decode_step = update_decode_step(carry.decode_step, x[:, lp:], new_x[:, lp:], mask_id, i)
    carry = DreamCarry(tokens=new_x, key=key, decode_step=decode_step)
    return carry, result.intervention_state, result.outputs


def _family(config: ModelConfig, options: DreamOptions, prompt) -> DreamFamily:
  mask_id = config.mask_token_id if options.mask_token_id is None else options.mask_token_id
  if mask_id is None:
    raise ValueError("Dream sampling needs a mask token id: set ModelConfig.mask_token_id or options.mask_token_id.")
  return DreamFamily(options=options, mask_id=mask_id, infill=bool(np.any(np.asarray(prompt) == mask_id)))


diffusion_generate = driver.public_sampler(_family, DreamOptions(), """Dream masked-diffusion generation
(module docstring), one compiled program per shape.

Args:
  params: model parameters (a config with logit_shift=1).
  prompt: [B, Lp] int token ids, left-padded for batches (Lp >= 1).
  config: model config (static).
  options: `DreamOptions` (static).
  key: PRNG key; default key(0); or [B] keys, one per row (see `dlm_jax.sampling.driver.run_family`).
  prompt_mask: [B, Lp] 1 = real token, 0 = pad; None = no padding.
  stats_spec, intervention, intervention_state, sink_top_k, attention_impl, query_chunk, loop,
    record_intervention: see `dlm_jax.sampling.driver.run_family`.

Returns:
  `Trace` with tokens [B, Lp + G], decode_step [B, G], nfe = steps, stats [steps, ...], top_sinks.
""")
