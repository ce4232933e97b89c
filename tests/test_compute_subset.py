"""A forward that computes part of the sequence (`dlm_jax.model.compute_subset`, the mechanism of compute
policies): query subsets and per-layer key subsets against an independent NumPy forward written for the test
(tests/numpy_transformer.py `subset_forward`), the skipped work equal to a full forward where nothing changed,
and bad subsets refused in one line."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlm_jax.config import preset
from dlm_jax.model import Compute, KVCache, forward, init_params
from dlm_jax.model.compute_subset import ComputeSubset

try:
  from tests import numpy_transformer as ref
except ImportError:  # run from inside tests/
  import numpy_transformer as ref

jax.config.update("jax_default_matmul_precision", "highest")

CONFIG = preset("tiny-llada")
B, S, T = 2, 12, 4


@functools.lru_cache(maxsize=None)
def _setup():
  params = init_params(CONFIG, jax.random.key(7))
  before = np.asarray(jax.random.randint(jax.random.key(8), (B, S), 0, 200))
  after = before.copy()
  after[0, [3, 9]] = [11, 12]
  after[1, [0, 5]] = [13, 14]
  cache = forward(params, jnp.asarray(before), config=CONFIG,
                  compute=Compute(cache=KVCache.zeros(CONFIG, B, S), cache_offset=0)).cache
  return params, before, after, cache


@jax.jit
def _subset_call(params, tokens, cache, queries, keys):
  query_tokens = jnp.take_along_axis(tokens, jnp.minimum(queries, S - 1), axis=1)
  return forward(params, query_tokens, config=CONFIG,
                 compute=Compute(cache=cache, subset=ComputeSubset(queries, keys))).logits


def _keys(rng, queries):
  """[L, B, m] random cached positions disjoint from each row's queries, one padded entry per row."""
  keys = np.full((CONFIG.n_layers, B, 5), S, np.int32)
  for l in range(CONFIG.n_layers):
    for b in range(B):
      others = [j for j in range(S) if j not in set(queries[b].tolist())]
      keys[l, b, :4] = np.sort(rng.choice(others, 4, replace=False))
  return keys


@pytest.mark.parametrize("with_keys", [False, True])
def test_a_subset_call_equals_the_numpy_subset_forward(with_keys):
  params, before, after, cache = _setup()
  queries = np.array([[3, 4, 9, S], [0, 5, 6, 11]], np.int32)  # row 0 has one padded entry
  keys = _keys(np.random.default_rng(0), queries) if with_keys else None
  got = np.asarray(_subset_call(params, jnp.asarray(after), cache, jnp.asarray(queries),
                                None if keys is None else jnp.asarray(keys)))
  expected = ref.subset_forward(params, after, CONFIG, ref.cached_kv(params, before, CONFIG), queries,
                                None if keys is None else list(keys))
  real = queries < S
  np.testing.assert_allclose(got[real], expected[real], atol=3e-5, rtol=3e-5)


def test_the_skipped_work_is_what_a_full_forward_computes_when_nothing_changed():
  params, before, _, cache = _setup()
  full = np.asarray(forward(params, jnp.asarray(before), config=CONFIG).logits)
  queries = np.array([[1, 2, 7, 10], [0, 3, 4, 8]], np.int32)
  got = np.asarray(_subset_call(params, jnp.asarray(before), cache, jnp.asarray(queries), None))
  np.testing.assert_allclose(got, np.take_along_axis(full, queries[..., None], axis=1), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("bad, message", [
    (dict(cache=None), "reads and writes a KVCache"),
    (dict(queries=np.zeros((B, T + 1), np.int32)), r"ComputeSubset.queries must be \[B, T\]"),
    (dict(keys=np.zeros((1, B, 3), np.int32)), r"ComputeSubset.keys must be \[L, B, m\]"),
    (dict(config="tiny-llama"), "needs bidirectional attention"),
])
def test_bad_subsets_are_refused_in_one_line(bad, message):
  params, before, _, cache = _setup()
  config = preset(bad.get("config", "tiny-llada"))
  queries = jnp.asarray(bad.get("queries", np.zeros((B, T), np.int32)))
  keys = bad.get("keys")
  if config.name != CONFIG.name:
    params, cache = init_params(config, jax.random.key(0)), KVCache.zeros(config, B, S)
  with pytest.raises(ValueError, match=message):
    forward(params, jnp.asarray(before[:, :T]), config=config,
            compute=Compute(cache=bad.get("cache", cache),
                            subset=ComputeSubset(queries, None if keys is None else jnp.asarray(keys))))
