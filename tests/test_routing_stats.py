"""Routing statistics (`StatsSpec.routing`): the experts and weights the router chose at every position and
layer, in the forward pass (against transformers GLM-4-MoE's own router outputs, captured by hooks), with
layer subsets and KV caches, and per sampler step (expert load) for LLaDA-MoE and LLaDA2 block diffusion."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlm_jax import model
from dlm_jax.config import preset
from dlm_jax.sampling import block_diffusion as bd
from dlm_jax.sampling import llada
from dlm_jax.instrument.stats import StatsSpec, expert_load
from dlm_jax.model import CallInstruments, Compute
from dlm_jax.sampling.run_setup import RunSetup

try:
  from tests import test_moe
except ImportError:
  import test_moe

jax.config.update("jax_default_matmul_precision", "highest")

ROUTING = StatsSpec(routing=True)


def _sorted(a):
  return np.sort(np.asarray(a), axis=-1)


def test_forward_routing_equals_the_reference_routers_choice():
  """GLM-4-MoE (a dense layer 0, then sigmoid group-limited MoE layers): our routed experts per layer and
  token are the sets its router modules chose, with the same weights; the dense layer reports none."""
  dims = dict(d=48, layers=3, heads=4, kv_heads=2, head_dim=16, dense_f=56, experts=16, k=4, f=20, shared=1,
              groups=4, kept=2, scale=2.5, rotary=8, vocab=83)
  reference = test_moe._glm4_moe(**dims, seed=7)
  config = preset("tiny-llada2").replace(
      d_model=48, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16, mlp_hidden=56, vocab_size=83, n_experts=16,
      experts_per_token=4, expert_hidden=20, shared_expert_hidden=20, router_groups=4, router_topk_groups=2,
      attention_block_size=None, mask_token_id=None, eos_token_id=None, pad_token_id=None)
  params = test_moe._hf_model_params(reference, config)
  records, handles = test_moe._capture_routing([layer.mlp.gate for layer in reference.model.layers[1:]])
  tokens = np.random.default_rng(3).integers(0, 83, size=21).tolist()
  test_moe.hf_fixtures.reference_outputs(reference, tokens, bidirectional=True)
  for h in handles:
    h.remove()
  out = model.forward(params, jnp.asarray([tokens]), config=config, instruments=CallInstruments(stats_spec=ROUTING))
  assert out.routed_experts.shape == (3, 1, 21, 4) and out.routing_weights.shape == (3, 1, 21, 4)
  assert (np.asarray(out.routed_experts[0]) == -1).all() and (np.asarray(out.routing_weights[0]) == 0).all()
  for layer, (_, weights, experts) in enumerate(records, start=1):
    ours_e, ours_w = np.asarray(out.routed_experts[layer, 0]), np.asarray(out.routing_weights[layer, 0])
    np.testing.assert_array_equal(_sorted(ours_e), _sorted(experts))
    order, theirs = np.argsort(ours_e, -1), np.argsort(experts, -1)
    np.testing.assert_allclose(np.take_along_axis(ours_w, order, -1), np.take_along_axis(weights, theirs, -1),
                               atol=1e-6, rtol=0)
  load = np.asarray(expert_load(out.routed_experts, 16))  # [L, B, E]
  assert load.shape == (3, 1, 16) and load[0].sum() == 0 and (load[1:].sum(-1) == 21 * 4).all()


@functools.lru_cache(maxsize=None)
def _tiny(name):
  config = preset(name)
  return config, model.init_params(config, jax.random.key(1))


@pytest.mark.parametrize("name", ["tiny-llada-moe", "tiny-llada2"])
def test_layer_subsets_and_cached_calls_place_the_choice_at_the_right_positions(name):
  config, params = _tiny(name)
  tokens = jax.random.randint(jax.random.key(2), (2, 12), 0, 250)
  full = model.forward(params, tokens, config=config, instruments=CallInstruments(stats_spec=ROUTING))
  subset = model.forward(params, tokens, config=config,
                         instruments=CallInstruments(stats_spec=StatsSpec(routing=True, layers=(1, 0))))
  np.testing.assert_array_equal(subset.routed_experts, full.routed_experts[jnp.asarray([1, 0])])
  np.testing.assert_allclose(subset.routing_weights, full.routing_weights[jnp.asarray([1, 0])], atol=1e-6, rtol=0)
  # A cached call over positions [4, 8) of an 8-slot cache (filled by a call over [0, 8)) reports those
  # positions only, with the choice of the uncached forward over [0, 8).
  cache = model.forward(params, tokens[:, :8], config=config,
                        compute=Compute(cache=model.KVCache.zeros(config, 2, 8))).cache
  call = model.forward(params, tokens[:, 4:8], config=config, compute=Compute(cache=cache, cache_offset=4),
                       instruments=CallInstruments(stats_spec=ROUTING))
  experts = np.asarray(call.routed_experts)
  assert experts.shape == (config.n_layers, 2, 8, config.experts_per_token)
  assert (experts[:, :, :4] == -1).all()
  assert (experts[config.first_k_dense:, :, 4:] >= 0).all()
  alone = model.forward(params, tokens[:, :8], config=config, instruments=CallInstruments(stats_spec=ROUTING))
  np.testing.assert_array_equal(_sorted(experts[:, :, 4:]), _sorted(alone.routed_experts[:, :, 4:]))


def test_dense_model_refuses_routing_statistics():
  config, params = _tiny("tiny-llada")
  with pytest.raises(ValueError, match="routing.*dense model"):
    model.forward(params, jnp.zeros((1, 4), jnp.int32), config=config, instruments=CallInstruments(stats_spec=ROUTING))


def test_llada_sampler_reports_routing_and_expert_load_per_step():
  config, params = _tiny("tiny-llada-moe")
  prompt = jax.random.randint(jax.random.key(4), (2, 5), 2, 250)
  options = llada.LLaDAOptions(gen_length=8, steps=4, block_length=8)
  spec = StatsSpec(routing=True, incoming_attention=True, per_head=False)
  trace = llada.generate(params, prompt, config=config, options=options, setup=RunSetup(stats_spec=spec))
  experts, load = np.asarray(trace.stats["routed_experts"]), np.asarray(trace.stats["expert_load"])
  assert experts.shape == (4, 2, 2, 13, 2) and load.shape == (4, 2, 2, 8)
  assert (experts >= 0).all() and (load.sum(-1) == 13 * 2).all()
  canvas = jnp.concatenate([prompt, jnp.full((2, 8), config.mask_token_id)], axis=1)
  first_step = model.forward(params, canvas, config=config,
                             instruments=CallInstruments(stats_spec=ROUTING))  # step 0 sees this canvas
  np.testing.assert_array_equal(_sorted(experts[0]), _sorted(first_step.routed_experts))


def test_block_diffusion_routing_covers_the_computed_block_only():
  config, params = _tiny("tiny-llada2")
  prompt = jax.random.randint(jax.random.key(5), (1, 6), 2, 250)
  options = bd.BlockDiffusionOptions(gen_length=6, block_length=4, steps=4, eos_stop=False)
  trace = bd.generate(params, prompt, config=config, options=options, setup=RunSetup(stats_spec=ROUTING))
  nfe = int(trace.nfe)
  experts, load = np.asarray(trace.stats["routed_experts"])[:nfe], np.asarray(trace.stats["expert_load"])[:nfe]
  queries = np.asarray(trace.computed_queries)[:nfe]
  for step in range(nfe):
    start, stop = queries[step]
    inside = np.zeros(experts.shape[3], bool)
    inside[start:stop] = True
    assert (experts[step, 1:, :, inside] >= 0).all() and (experts[step, :, :, ~inside] == -1).all()
    assert (experts[step, 0] == -1).all()  # the dense layer
    assert (load[step, 1:].sum(-1) == (stop - start) * 2).all()


def test_expert_counts_shares_and_js_divergence_against_loops():
  from dlm_jax.analysis import routing  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(0)
  experts = rng.integers(-1, 5, size=(3, 2, 7, 2))
  select = rng.random((3, 2, 7)) > 0.4
  counts = routing.expert_counts(experts, select, 5)
  want = np.zeros((2, 5), np.int64)
  for t, l, s, j in np.ndindex(experts.shape):
    if select[t, l, s] and experts[t, l, s, j] >= 0:
      want[l, experts[t, l, s, j]] += 1
  np.testing.assert_array_equal(counts, want)
  p = routing.shares(counts)
  np.testing.assert_allclose(p.sum(-1), 1.0)
  assert np.allclose(routing.js_divergence(p, p), 0.0)
  np.testing.assert_allclose(routing.js_divergence(np.array([1.0, 0.0]), np.array([0.0, 1.0])), 1.0)
  q = np.array([0.5, 0.5])
  r = np.array([0.9, 0.1])
  m = (q + r) / 2
  expected = 0.5 * np.sum(q * np.log2(q / m)) + 0.5 * np.sum(r * np.log2(r / m))
  np.testing.assert_allclose(routing.js_divergence(q, r), expected)
