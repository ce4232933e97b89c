"""The uniform-state (DiffusionGemma-style) objective against a reference assembled here: the noisy canvas
built in NumPy from the replayed draws, the encoder and the two decoder passes called one by one through
`model.forward` (the forward itself is checked against transformers in test_diffusion_gemma.py), and the
cross-entropy in float64 NumPy; plus its gradient (the first pass is a constant), its draws and its errors."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlm_jax import model, training
from dlm_jax.training import uniform as training_uniform
from dlm_jax.config import preset
from dlm_jax.training.loop import TrainConfig
from dlm_jax.model import Compute
from tests.light_configs import DIFFUSIONGEMMA_SG

jax.config.update("jax_default_matmul_precision", "highest")

CONFIG = DIFFUSIONGEMMA_SG
P, C, B = 6, 5, 4
NOISE = training_uniform.UniformNoise(prompt_len=P, self_conditioning_rate=0.5)


def _batch(seed: int = 0) -> np.ndarray:
  return np.random.default_rng(seed).integers(3, CONFIG.vocab_size, (B, P + C)).astype(np.int32)


# The reference calls the forward one call at a time, jitted (an eager `lax.scan` is dispatched primitive by
# primitive, which once segfaulted in XLA CPU under the parallel suite).
_forward = jax.jit(model.forward, static_argnames=("config",))


def _first_pass(params, noisy: np.ndarray, encoded) -> list[np.ndarray]:
  """Per row b, the first decoder pass's logits [1, C, V] (float64): row by row, so that it and the second
  pass's rows without the signal are one compiled program."""
  return [np.asarray(_forward(params, jnp.asarray(noisy[b:b + 1]), config=CONFIG,
                              cache=jax.tree.map(lambda x: x[:, b:b + 1], encoded), cache_offset=P,
                              decoder=model.DecoderCall()).logits, np.float64) for b in range(B)]


def _reference_loss(params, tokens: np.ndarray, draws) -> float:
  prompt, clean = tokens[:, :P], tokens[:, P:]
  noisy = np.where(np.asarray(draws.noised), np.asarray(draws.ids), clean)
  encoded = _forward(params, jnp.asarray(prompt), config=CONFIG, cache=model.KVCache.zeros(CONFIG, B, P + C),
                          cache_offset=0).cache
  first = _first_pass(params, noisy, encoded)
  temperature = np.asarray(draws.temperature, np.float64)
  use = np.asarray(draws.self_conditioned)
  second = []
  for b in range(B):  # rows without the signal: a decoder call with no self-conditioning logits at all
    logits = first[b] / temperature[b] if use[b] else None
    out = _forward(params, jnp.asarray(noisy[b:b + 1]), config=CONFIG,
                        cache=jax.tree.map(lambda x: x[:, b:b + 1], encoded), cache_offset=P,
                        decoder=model.DecoderCall(None if logits is None else jnp.asarray(logits, jnp.float32)))
    second.append(np.asarray(out.logits, np.float64)[0])
  logits = np.stack(second)
  top = logits.max(-1, keepdims=True)
  logz = top[..., 0] + np.log(np.exp(logits - top).sum(-1))
  picked = np.take_along_axis(logits, clean[..., None], axis=-1)[..., 0]
  return float(np.mean(logz - picked))


@pytest.fixture(scope="module")
def params():
  return model.init_params(CONFIG, jax.random.key(1))


@pytest.fixture(scope="module")
def loss_and_gradient():
  """`((loss, metrics), gradient)` of `training_uniform.loss`: one compiled program for the loss and gradient
  tests (params, tokens [B, P + C], key)."""
  return jax.jit(jax.value_and_grad(
      lambda p, t, k: training_uniform.loss(p, t, k, config=CONFIG, noise=NOISE), has_aux=True))


def test_loss_matches_the_reference(params, loss_and_gradient):
  tokens, key = _batch(), jax.random.key(7)
  draws = training_uniform.draw(key, B, C, CONFIG.vocab_size, NOISE)
  assert np.asarray(draws.self_conditioned).any() and not np.asarray(draws.self_conditioned).all()
  (value, metrics), _ = loss_and_gradient(params, jnp.asarray(tokens), key)
  expected = _reference_loss(params, tokens, draws)
  print(f"uniform loss {float(value):.6f} reference {expected:.6f}")
  assert abs(float(value) - expected) < 1e-5 and metrics["scored"] == B * C
  wrong = dataclasses.replace(draws, self_conditioned=~draws.self_conditioned)
  assert abs(_reference_loss(params, tokens, wrong) - expected) > 1e-4  # the signal matters at this size


def test_first_pass_is_a_constant_in_the_gradient(params, loss_and_gradient):
  """The gradient equals the one of the second pass with the first pass's logits fed in as data."""
  tokens, key = jnp.asarray(_batch(1)), jax.random.key(3)
  draws = training_uniform.draw(key, B, C, CONFIG.vocab_size, NOISE)
  prompt, clean = tokens[:, :P], tokens[:, P:]
  noisy = jnp.where(draws.noised, draws.ids, clean)
  cache = model.KVCache.zeros(CONFIG, B, P + C)
  encoded = _forward(params, prompt, config=CONFIG, cache=cache, cache_offset=0).cache
  first = jnp.asarray(np.concatenate(_first_pass(params, np.asarray(noisy), encoded)), jnp.float32)
  signal = first / draws.temperature[:, None, None]

  def second_only(p):
    enc = model.forward(p, prompt, config=CONFIG, compute=Compute(cache=cache, cache_offset=0)).cache
    logits = model.forward(p, noisy, config=CONFIG,
                           compute=Compute(cache=enc, cache_offset=P,
                                           decoder=model.DecoderCall(signal, draws.self_conditioned))).logits
    return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, clean[..., None], -1)[..., 0])

  _, ours = loss_and_gradient(params, tokens, key)
  ours, expected = jax.device_get((ours, jax.jit(jax.grad(second_only))(params)))  # compared in NumPy
  worst = max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(expected)))
  scale = max(float(np.max(np.abs(b))) for b in jax.tree.leaves(expected))
  print(f"gradient max|diff| {worst:.2e} (largest entry {scale:.2e})")
  assert worst <= 1e-5 * max(scale, 1.0)
  assert float(np.max(np.abs(ours["self_conditioning"]["mlp"]["down"]["kernel"]))) > 0  # the module learns


def test_draws():
  noise = training_uniform.UniformNoise(prompt_len=P, self_conditioning_rate=0.25, t_min=0.5, t_max=0.7)
  draws = training_uniform.draw(jax.random.key(0), 4000, 16, CONFIG.vocab_size, noise)
  p, noised = np.asarray(draws.p), np.asarray(draws.noised)
  assert 1e-3 <= p.min() and p.max() <= 1.0
  assert abs(noised.mean() - p.mean()) < 0.01 and np.corrcoef(noised.mean(1), p)[0, 1] > 0.9
  ids = np.asarray(draws.ids)
  assert ids.min() == 0 and ids.max() == CONFIG.vocab_size - 1  # the whole vocabulary, as the sampler renoises
  assert abs(np.asarray(draws.self_conditioned).mean() - 0.25) < 0.03
  t = np.asarray(draws.temperature)
  assert 0.5 <= t.min() and t.max() <= 0.7


def test_train_step_lowers_the_loss(params):
  """A few optimizer steps on one batch and one noise draw fit it."""
  objective = TrainConfig(objective="uniform", prompt_len=P).objective_spec()
  optimizer = training.make_optimizer(lr=3e-3, total_steps=20, warmup_steps=0)
  step = training.make_train_step(CONFIG, objective, optimizer)
  state = training.init_train_state(CONFIG, jax.random.key(0), optimizer, objective)
  batch = {"tokens": jnp.asarray(_batch(2)), "prompt_mask": jnp.zeros((B, P + C), bool).at[:, :P].set(True),
           "target_mask": jnp.ones((B, P + C), bool)}
  losses = []
  for i in range(20):
    state, metrics = step(state, batch, jax.random.key(0))  # the same noise: a deterministic descent
    losses.append(float(metrics["loss"]))
  print("losses", [round(x, 3) for x in losses])
  assert losses[-1] < 0.7 * losses[0]


def test_errors():
  with pytest.raises(ValueError, match="DiffusionGemma-style config"):
    training.Objective("uniform", uniform=NOISE).check(preset("tiny-llada"))
  with pytest.raises(ValueError, match="needs prompt_len"):
    TrainConfig(objective="uniform").objective_spec()
  with pytest.raises(ValueError, match="sink token"):
    training.Objective("uniform", sink=training.SinkTokenSpec(4), uniform=NOISE)
  with pytest.raises(ValueError, match="UniformNoise settings"):
    training.Objective("sft", uniform=NOISE)
  with pytest.raises(ValueError, match="self_conditioning_rate"):
    training_uniform.UniformNoise(prompt_len=4, self_conditioning_rate=1.5)
  with pytest.raises(ValueError, match="answer canvas"):
    training_uniform.loss(None, jnp.zeros((2, P), jnp.int32), jax.random.key(0), config=CONFIG, noise=NOISE)
