"""dLLM-Cache's decision functions against NumPy replays of the official hook (maomaocun/dLLM-cache
`cache_hook_LLaDA.py` `cache_hook_feature` / `refresh_index`, the `dLLMCache` class's per-layer counters
and `refresh_gen` / `refresh_prompt`), written here: the counters as the class keeps them, the four branches of
the hook as it chooses what each layer recomputes, the lowest-similarity set by a sort."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlm_jax.policy import dllm_cache
from dlm_jax.policy.dllm_cache import DLLMCacheSettings

jax.config.update("jax_default_matmul_precision", "highest")


class ReplayCounters:
  """The official per-layer step counters: each layer increments its own; every layer reads the max."""

  def __init__(self, settings):
    self.settings, self.counter = settings, {}

  def layer_flags(self, layer):
    self.counter[layer] = self.counter.get(layer, 0) + 1
    current = max(self.counter.values(), default=1)
    gen = (current - 1) % self.settings.gen_interval_steps == 0
    prompt = (current - 1) % self.settings.prompt_interval_steps == 0
    if self.settings.refresh_layer0 and layer == 0:
      gen = prompt = True
    return prompt, gen


@functools.lru_cache(maxsize=None)
def schedule_fn(settings):
  return jax.jit(functools.partial(dllm_cache.schedule, settings))


@pytest.mark.parametrize("refresh_layer0", [True, False])
def test_schedule_replays_the_official_counters(refresh_layer0):
  settings = DLLMCacheSettings(prompt_interval_steps=5, gen_interval_steps=3, refresh_layer0=refresh_layer0)
  n_calls, n_layers = 12, 3
  replay = ReplayCounters(settings)
  want = np.array([[replay.layer_flags(layer) for layer in range(n_layers)] for _ in range(n_calls)])
  calls = np.broadcast_to(np.arange(n_calls, dtype=np.int32)[:, None], (n_calls, n_layers))
  layers = np.broadcast_to(np.arange(n_layers, dtype=np.int32)[None, :], (n_calls, n_layers))
  prompt, gen = schedule_fn(settings)(jnp.asarray(calls), jnp.asarray(layers))
  np.testing.assert_array_equal(np.asarray(prompt), want[..., 0])
  np.testing.assert_array_equal(np.asarray(gen), want[..., 1])
  assert bool(want[0].all())                                   # the first call is full everywhere
  assert want[1:, 0].all() == refresh_layer0                   # layer 0 always full only with the quirk


def replay_plan(settings, fresh, cached, prompt_full, gen_full, prompt_length):
  """The hook's four branches: which positions get Q/K/attention/FFN recomputed, which V replaced."""
  b, g = fresh.shape[:2]
  count = int(g * settings.transfer_ratio)
  transfer = 0 < settings.transfer_ratio <= 1 and count > 0
  queries = np.zeros((b, prompt_length + g), bool)
  values = np.zeros_like(queries)
  for row in range(b):
    x, y = fresh[row].reshape(g, -1), cached[row].reshape(g, -1)
    cos = (x * y).sum(-1) / np.maximum(np.linalg.norm(x, axis=-1) * np.linalg.norm(y, axis=-1), 1e-8)
    index = prompt_length + np.argsort(cos, kind="stable")[:count]
    if prompt_full[row]:
      queries[row, :prompt_length] = values[row, :prompt_length] = True
    if gen_full[row]:
      queries[row, prompt_length:] = values[row, prompt_length:] = True
    elif transfer:
      queries[row, index] = True
      values[row, prompt_length:] = True
  return queries, values


@functools.lru_cache(maxsize=None)
def plan_fn(settings, prompt_length):
  def plan(fresh, cached, call_index, layer):
    return dllm_cache.layer_plan(settings, dllm_cache.value_similarity(fresh, cached), call_index, layer,
                                 prompt_length)
  return jax.jit(plan)


@pytest.mark.parametrize("ratio", [0.25, 0.05])
def test_layer_plan_matches_the_hook_branches(ratio):
  """ratio 0.25 of 10 positions refreshes 2; 0.05 gives ⌊0.5⌋ = 0: no adaptive refresh, V kept."""
  rng = np.random.default_rng(3)
  settings = DLLMCacheSettings(prompt_interval_steps=4, gen_interval_steps=3, transfer_ratio=ratio)
  b, p, g, heads, dim = 4, 3, 10, 2, 4
  fresh = rng.normal(size=(b, g, heads, dim))
  cached = fresh + rng.normal(size=(b, g, heads, dim)) * rng.uniform(0.1, 2.0, size=(b, g, 1, 1))
  call_index = np.array([0, 3, 4, 5], np.int32)      # full, response only, prompt only, neither
  for layer in (0, 2):
    queries, values = plan_fn(settings, p)(jnp.asarray(fresh, jnp.float32), jnp.asarray(cached, jnp.float32),
                                           jnp.asarray(call_index), jnp.int32(layer))
    prompt_full = (call_index % 4 == 0) | (layer == 0)
    gen_full = (call_index % 3 == 0) | (layer == 0)
    want = replay_plan(settings, fresh, cached, prompt_full, gen_full, p)
    np.testing.assert_array_equal(np.asarray(queries), want[0])
    np.testing.assert_array_equal(np.asarray(values), want[1])


def test_refresh_count_is_pythons_int_of_the_product():
  assert DLLMCacheSettings(transfer_ratio=0.25).refresh_count(256) == 64
  assert DLLMCacheSettings(transfer_ratio=0.3).refresh_count(10) == 3
  assert DLLMCacheSettings(transfer_ratio=0.0).refresh_count(256) == 0


@pytest.mark.parametrize("knobs, message", [
    ({"prompt_interval_steps": 0}, "dllm_cache prompt_interval_steps must be an int >= 1"),
    ({"gen_interval_steps": 2.0}, "dllm_cache gen_interval_steps must be an int >= 1"),
    ({"transfer_ratio": 1.5}, "dllm_cache transfer_ratio must be a number in [0, 1]"),
    ({"transfer_ratio": -0.1}, "dllm_cache transfer_ratio must be a number in [0, 1]"),
    ({"refresh_layer0": "yes"}, "dllm_cache refresh_layer0 must be True or False"),
])
def test_bad_knobs_refused_in_one_line(knobs, message):
  with pytest.raises(ValueError) as error:
    DLLMCacheSettings(**knobs)
  assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_published_values_and_refusals():
  assert DLLMCacheSettings() == DLLMCacheSettings.published("llada", "gsm8k")
  assert DLLMCacheSettings.published("dream", "humaneval") == DLLMCacheSettings(50, 1, 0.25)
  assert DLLMCacheSettings.published("llada-base", "gsm8k") == DLLMCacheSettings(25, 5, 0.25)
  assert DLLMCacheSettings.published("mmada", "mbpp") == DLLMCacheSettings.published("llada", "mbpp")
  assert DLLMCacheSettings.NAME == "dllm_cache" and DLLMCacheSettings().refresh_layer0
  with pytest.raises(ValueError, match="dllm_cache published family"):
    DLLMCacheSettings.published("gpt2")
  with pytest.raises(ValueError, match="dllm_cache published task"):
    DLLMCacheSettings.published("llada", "lambada")
