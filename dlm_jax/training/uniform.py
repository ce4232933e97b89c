"""A uniform-state (DiffusionGemma-style) training objective: "uniform".

The published DiffusionGemma material (models_2026.md §8.3) fixes the model and its sampler but not its
training recipe, so this objective is our reading of what the sampler expects — UNVERIFIED against
Google's training code, with its two free choices configurable (`UniformNoise`). For the "sft" data
layout, tokens [B, P + C] = a prompt region [B, P] and an answer canvas [B, C]:

  1. the encoder (causal) runs over the prompt and fills the KV cache, as at sampling time;
  2. noise: per row t ~ U(0, 1), p = (1 − ε)·t + ε; every canvas position is independently replaced with
     probability p by a uniformly random id over the whole vocabulary (the sampler's renoising
     distribution: a replaced position may draw its own clean id);
  3. self-conditioning: a first decoder pass over the noisy canvas without a signal; its logits, divided by
     a temperature T ~ U(t_min, t_max) per row (the sampler feeds temperature-scaled logits) and with
     gradients stopped, are the self-conditioning input of a second pass — for a fraction
     `self_conditioning_rate` of the rows, the others get the zero signal (the sampler's first step);
  4. loss = the mean cross-entropy of the second pass against the clean canvas over every canvas position,
     noised or not (nothing is frozen at sampling time, so every position must be predicted).

The encoder's own logits are never scored; it learns through the keys and values the decoder reads.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from dlm_jax.config import ModelConfig
from dlm_jax.model import DecoderCall, KVCache, Params, forward
from dlm_jax.model.forward_inputs import Compute, Readout

UNIFORM_EPS = 1e-3


@dataclasses.dataclass(frozen=True)
class UniformNoise:
  """The free choices of the "uniform" objective (module docstring).

  prompt_len: P, the prompt region of the batch (static: the encoder / decoder split).
  self_conditioning_rate: fraction of rows trained with the first pass's logits as the signal.
  t_min, t_max: the range of the temperature dividing those logits (the sampler's schedule, 0.4–0.8).
  eps: the floor of the noise probability.
  """

  prompt_len: int
  self_conditioning_rate: float = 0.5
  t_min: float = 0.4
  t_max: float = 0.8
  eps: float = UNIFORM_EPS

  def __post_init__(self):
    if isinstance(self.prompt_len, bool) or not isinstance(self.prompt_len, int) or self.prompt_len < 1:
      raise ValueError(f"UniformNoise.prompt_len must be a positive integer, got {self.prompt_len!r}.")
    if not 0.0 <= self.self_conditioning_rate <= 1.0:
      raise ValueError(f"UniformNoise.self_conditioning_rate must be in [0, 1], got {self.self_conditioning_rate}.")
    if not 0.0 < self.t_min <= self.t_max:
      raise ValueError(f"UniformNoise needs 0 < t_min <= t_max, got t_min={self.t_min}, t_max={self.t_max}.")


@dataclasses.dataclass(frozen=True)
class UniformDraws:
  """One draw of the objective's randomness for a canvas [B, C].

  p: [B] noise probability; noised: [B, C] bool; ids: [B, C] int32 uniform replacement ids;
  self_conditioned: [B] bool rows given the first pass's logits; temperature: [B] float32.
  """

  p: jax.Array
  noised: jax.Array
  ids: jax.Array
  self_conditioned: jax.Array
  temperature: jax.Array


def draw(key: jax.Array, batch: int, canvas: int, vocab_size: int, noise: UniformNoise) -> UniformDraws:
  """The objective's random draws (a pure function of the key, so a test can replay them)."""
  k_t, k_noised, k_ids, k_sc, k_temp = jax.random.split(key, 5)
  t = jax.random.uniform(k_t, (batch,), jnp.float32)
  p = (1.0 - noise.eps) * t + noise.eps
  return UniformDraws(
      p=p, noised=jax.random.uniform(k_noised, (batch, canvas), jnp.float32) < p[:, None],
      ids=jax.random.randint(k_ids, (batch, canvas), 0, vocab_size, jnp.int32),
      self_conditioned=jax.random.uniform(k_sc, (batch,), jnp.float32) < noise.self_conditioning_rate,
      temperature=jax.random.uniform(k_temp, (batch,), jnp.float32, noise.t_min, noise.t_max))


def check(config: ModelConfig) -> None:
  """Raises ValueError unless `config` is a DiffusionGemma-style model (causal encoder, self-conditioning)."""
  if not (config.causal and config.self_conditioning):
    raise ValueError(f"Objective 'uniform' needs a DiffusionGemma-style config (causal=True, "
                     f"self_conditioning=True); {config.name} has causal={config.causal}, "
                     f"self_conditioning={config.self_conditioning}.")


def canvas_logits(params: Params, prompt: jax.Array, noisy: jax.Array, draws: UniformDraws, *,
                  config: ModelConfig, attention_impl: str = "chunked") -> jax.Array:
  """float32 logits [B, C, V] of the second decoder pass (module docstring, 1 and 3) for a prompt [B, P]
  and a noisy canvas [B, C]."""
  b, p = prompt.shape
  cache = KVCache.zeros(config, b, p + noisy.shape[1], params["embed"]["embedding"].dtype)
  encoded = forward(params, prompt, config=config, readout=Readout(window=(p - 1, p)),
                    compute=Compute(attention_impl=attention_impl, cache=cache, cache_offset=0)).cache

  def decode(sc_logits, sc_mask):
    decoder = DecoderCall(self_conditioning_logits=sc_logits, self_conditioning_mask=sc_mask)
    return forward(params, noisy, config=config, compute=Compute(attention_impl=attention_impl, cache=encoded,
                                                                 cache_offset=p, decoder=decoder)).logits

  first = jax.lax.stop_gradient(decode(None, None))
  return decode(first / draws.temperature[:, None, None], draws.self_conditioned)


def loss(params: Params, tokens: jax.Array, key: jax.Array, *, config: ModelConfig, noise: UniformNoise,
         attention_impl: str = "chunked") -> tuple[jax.Array, dict[str, jax.Array]]:
  """(mean CE over the canvas, {loss, scored, accuracy}) for tokens [B, P + C] of the "sft" layout."""
  prompt, clean = tokens[:, :noise.prompt_len], tokens[:, noise.prompt_len:]
  if clean.shape[1] < 1:
    raise ValueError(f"Objective 'uniform' needs an answer canvas after prompt_len={noise.prompt_len}; the batch "
                     f"has {tokens.shape[1]} positions.")
  draws = draw(key, *clean.shape, config.vocab_size, noise)
  noisy = jnp.where(draws.noised, draws.ids, clean)
  logits = canvas_logits(params, prompt, noisy, draws, config=config, attention_impl=attention_impl)
  logits = logits.astype(jnp.float32)
  value = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, clean))
  accuracy = jnp.mean((jnp.argmax(logits, -1) == clean).astype(jnp.float32))
  return value, {"loss": value, "scored": jnp.asarray(clean.size, jnp.int32), "accuracy": accuracy}
