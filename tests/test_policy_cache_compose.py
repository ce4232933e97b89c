"""Sparse-dLLM with Fast-dLLM's prefix and dual KV caches (issue 36 item 3; our composition, not an official
method): whole threshold runs against a replay written here (a Python loop over the independent NumPy forward of
tests/numpy_transformer.py: the cache's refresh, its query window over every cached key at a block's call 1 — the
call that scores the keys — then over the kept cached keys only, the rule in NumPy), every key kept giving the
plain cache's tokens on Dream, the skipped keys leaving XLA's FLOP count as `dlm_jax.policy.cost` says, and the
policies that do not compose refused in one line before compiling."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlm_jax import model
from dlm_jax.config import preset
from dlm_jax.model import KVCache, forward
from dlm_jax.model.compute_subset import ComputeSubset
from dlm_jax.policy.base import RunLayout
from dlm_jax.policy.registry import parse_policy
from dlm_jax.sampling import dream, driver, llada
from dlm_jax.session import decoding_mode
from dlm_jax.session.errors import SessionError
from dlm_jax.sampling.run_setup import RunSetup

try:
  from tests import numpy_transformer as ref
  from tests.test_policy_modes import peaked_params, prompts
  from tests.threshold_replay import threshold_commits
except ImportError:  # run from inside tests/
  import numpy_transformer as ref
  from test_policy_modes import peaked_params, prompts
  from threshold_replay import threshold_commits

jax.config.update("jax_default_matmul_precision", "highest")

CONFIG = preset("tiny-llada")
MASK = CONFIG.mask_token_id
LP, GEN, BLOCK, TAU = 5, 16, 8, 0.9
SPARSE = "sparse_dllm:keep_ratio=0.5,tie_break=lowest_position"


@functools.lru_cache(maxsize=None)
def generate(cache):
  """Both prompts in one batch, threshold decoding with `cache` under Sparse-dLLM."""
  options = llada.LLaDAOptions(gen_length=GEN, steps=GEN, block_length=BLOCK, threshold=TAU, cache=cache)
  return llada.generate(peaked_params(), prompts(), config=CONFIG, options=options,
                        setup=RunSetup(policy=parse_policy(SPARSE)))


def _kept(queries, cache, start):
  """Sparse-dLLM's kept keys per layer (NumPy): the head mean of the block-mean post-RoPE query (the block's rows of
  the call's queries [L][1, T, N, H], the block first) . every cached post-RoPE key, the keys outside
  [start, start + BLOCK) laid end to end, max-pooled (kernel 3, -inf padding), the top half kept (ties: lowest
  position first), ascending."""
  total = LP + GEN
  outside = np.array([j for j in range(total) if not start <= j < start + BLOCK])
  group = CONFIG.n_heads // CONFIG.n_kv_heads
  kept = []
  for layer in range(CONFIG.n_layers):
    q_mean = queries[layer][0, :BLOCK].mean(axis=0)  # [N, H]
    k = cache[layer][0][0]  # [S, K, H]
    scores = np.mean([k[:, h // group] @ q_mean[h] for h in range(CONFIG.n_heads)], axis=0)
    padded = np.concatenate([[-np.inf], scores[outside], [-np.inf]])
    pooled = np.max([padded[j:j + len(outside)] for j in range(3)], axis=0)
    order = sorted(range(len(outside)), key=lambda j: (-pooled[j], j))
    kept.append(np.sort(outside[order[:int(len(outside) * 0.5)]]))
  return kept


def replay(prompt, cache_mode, margins):
  """One row of Fast-dLLM threshold decoding (τ = TAU, blocks of BLOCK) with the `cache_mode` ("dual" or "prefix")
  cache under Sparse-dLLM, every call through the NumPy forward: (tokens [S], decode_step [G], nfe, computed
  [nfe, S] bool, kept {call: [L][n_keep]}).

  A block's call 0 is the refresh (the whole sequence; every position's keys and values cached); its later calls
  compute the cache's window — the block (dual) or [start, S) (prefix) — writing their keys and values into the
  cache, at call 1 over every cached key (the block's queries then score the keys), from call 2 over the kept
  cached keys outside the window and the window's own. `margins` collects |confidence − τ| of every candidate
  and the gap between the two most confident. slots [nfe]: the key slots the program gives each query of a
  call — all S at calls 0 and 1, from call 2 on the n_keep kept-key slots (a kept key inside the window is a
  padded slot, gathered all the same) and the window."""
  x = np.concatenate([prompt, np.full(GEN, MASK)]).astype(np.int64)
  total = len(x)
  decode_step = np.full(GEN, -1)
  nfe, computed, kept_at, cache, kept, slots = 0, [], {}, None, None, []
  for start in range(LP, total, BLOCK):
    window = np.arange(start, start + BLOCK) if cache_mode == "dual" else np.arange(start, total)
    step = 0
    while step < BLOCK and np.any(x[start:start + BLOCK] == MASK):
      if step == 0:
        logits, _ = ref.forward_sites(peaked_params(), x[None], CONFIG)
        cache = ref.cached_kv(peaked_params(), x[None], CONFIG)
        queries = np.arange(total)
      else:
        queries = window
        keys = None if step == 1 else [np.setdiff1d(layer_keys, window)[None] for layer_keys in kept]
        layer_queries = []
        rows, cache = ref.subset_forward(peaked_params(), x[None], CONFIG, cache, window[None], keys,
                                         return_cache=True, queries_out=layer_queries)
        logits = np.zeros((1, total, CONFIG.vocab_size))
        logits[0, window] = rows[0]
        if step == 1:
          kept = _kept(layer_queries, cache, start)
        kept_at[nfe] = kept
      computed.append(np.isin(np.arange(total), queries))
      slots.append(total if step <= 1 else len(kept[0]) + len(window))
      candidates = np.flatnonzero(x[start:start + BLOCK] == MASK) + start
      chosen, x0 = threshold_commits(logits[0, candidates], TAU, margins)
      for j in chosen:
        x[candidates[j]] = x0[j]
        decode_step[candidates[j] - LP] = nfe
      nfe += 1
      step += 1
  return x, decode_step, nfe, np.array(computed), kept_at, slots


@pytest.mark.parametrize("cache", ["dual", "prefix"])
def test_threshold_decoding_with_a_cache_under_sparse_dllm_is_the_replay(cache):
  """Both rows in one batch (a row waits while the other finishes its block): each row's tokens, its decode order
  and its calls' computed positions and kept keys (the calls it decoded in) are those of its replay alone, and
  the policy's FLOP count of each call (`call_flops`, as experiments.policy_sweep reads it from the trace) is the
  analytic count of what the call computes (`replay`'s slots)."""
  trace = generate(cache)
  active = np.asarray(trace.active_rows)[:int(trace.nfe)]
  assert not active.all(), "no row waited for the batch"
  margins, lengths, padded = [], set(), 0
  policy = parse_policy(SPARSE).bind(RunLayout(seq_len=LP + GEN, gen_start=LP, block_length=BLOCK,
                                               steps_per_block=BLOCK, cache=cache))
  for row, prompt in enumerate(prompts()):
    tokens, decode_step, nfe, computed, kept_at, slots = replay(prompt, cache, margins)
    own = np.cumsum(active[:, row]) - 1  # the batch's call -> the row's own call
    np.testing.assert_array_equal(np.asarray(trace.tokens)[row], tokens, err_msg=f"{cache} row {row}")
    np.testing.assert_array_equal(own[np.asarray(trace.decode_step)[row]], decode_step, err_msg=f"{cache} row {row}")
    assert int(active[:, row].sum()) == nfe
    np.testing.assert_array_equal(np.asarray(trace.computed_positions)[:int(trace.nfe), row][active[:, row]], computed)
    record = np.asarray(trace.policy_record)[:int(trace.nfe), row][active[:, row]]  # [nfe, L, n_keep]
    for call, kept in kept_at.items():
      np.testing.assert_array_equal(record[call], np.stack(kept), err_msg=f"{cache} row {row} call {call}")
    keys = np.asarray(trace.keys_read)[:int(trace.nfe), row][active[:, row]]
    for call, call_slots in enumerate(slots):
      flops = policy.call_flops(CONFIG, computed[call], float(keys[call]), record[call])
      assert flops == ref.trunk_flops(CONFIG, computed[call].sum(), call_slots), (cache, row, call, flops)
      padded += keys[call] < call_slots
    lengths |= {int(decode_step[:BLOCK].max() - decode_step[:BLOCK].min() + 1),
                int(decode_step[BLOCK:].max() - decode_step[BLOCK:].min() + 1)}
  assert min(margins) > 1e-4, "a decision of the replay is within rounding of flipping: change the case"
  assert len(lengths) > 1 and max(lengths) >= 3, f"block lengths {lengths}: variable blocks not exercised"
  keys = np.asarray(trace.keys_read)[:int(trace.nfe)]
  assert keys.min() < LP + GEN, "no call read a subset of the cached keys"
  assert padded or cache == "dual", "no prefix-cache call gathered a kept key inside its window (a padded slot)"


def test_every_key_kept_on_dreams_dual_cache_is_the_plain_dual_cache():
  """keep_ratio 1 keeps every cached key, so Dream's exact-count run (Fast-dLLM's per-block quota) with the dual
  cache under Sparse-dLLM is the plain dual-cache run (the family's own cached calls, not the policy's); the calls
  after a block's first compute the block only."""
  config = preset("tiny-dream")
  params = model.init_params(config, jax.random.key(3))
  options = dream.DreamOptions(gen_length=8, steps=8, block_length=4, alg="entropy", cache="dual")
  plain = dream.diffusion_generate(params, prompts(), config=config, options=options)
  every = dream.diffusion_generate(params, prompts(), config=config, options=options,
                                   policy=parse_policy("sparse_dllm:keep_ratio=1.0,tie_break=lowest_position"))
  np.testing.assert_array_equal(every.tokens, plain.tokens)
  np.testing.assert_array_equal(every.decode_step, plain.decode_step)
  assert int(every.nfe) == int(plain.nfe)
  computed = np.asarray(every.computed_positions)[:int(every.nfe)]
  starts = [int(every.decode_step[0, k]) for k in (0, 4)]  # the block-start call decodes a block's first position
  for call in range(int(every.nfe)):
    block = max(k for k, first in enumerate(starts) if first <= call)
    expected = np.ones(LP + 8, bool) if call == starts[block] else np.isin(np.arange(LP + 8),
                                                                           LP + 4 * block + np.arange(4))
    np.testing.assert_array_equal(computed[call], np.broadcast_to(expected, computed[call].shape), err_msg=f"{call}")


def test_the_dropped_cached_keys_leave_the_flop_count():
  """A cached call of n queries over m kept-key slots, the last third padded (a kept key inside the prefix cache's
  window, a sink the score already kept), against the same call over all S cached keys (one layer, dense attention:
  XLA's cost analysis counts a loop body once): each within 10% of the analytic count over the m slots, padded ones
  included, the drop is the analytic one, and Sparse-dLLM's own count of the call from what the trace records (the
  computed queries, the real keys read, the kept keys) is that count, with the dual cache and with keep_sinks
  without a cache."""
  config = dataclasses.replace(CONFIG, n_layers=1)
  s, n, m = 128, 16, 24
  # The cost analysis reads shapes only: the weights and the cache as shapes, no random-number program compiled.
  params = jax.eval_shape(lambda: model.init_params(config, jax.random.key(0)))
  tokens = jnp.zeros((1, s), jnp.int32)
  cache = jax.eval_shape(lambda: KVCache.zeros(config, 1, s))
  queries = jnp.arange(64, 64 + n, dtype=jnp.int32)[None]
  kept = np.where(np.arange(m) < 16, np.arange(m), s).astype(np.int32)
  keys = jnp.asarray(kept)[None, None]

  def flops(fn, *args):
    return jax.jit(fn).lower(*args).compile().cost_analysis()["flops"]

  def call(kept):
    return lambda p, t, c: forward(p, t[:, :n], config=config, cache=c, subset=ComputeSubset(queries, kept),
                                   return_hidden=True, attention_impl="dense").hidden

  every = flops(call(None), params, tokens, cache)
  subset = flops(call(keys), params, tokens, cache)
  analytic_every, analytic_subset = ref.trunk_flops(config, n, s), ref.trunk_flops(config, n, m + n)
  assert abs(every / analytic_every - 1) < 0.1 and abs(subset / analytic_subset - 1) < 0.1, (every, subset)
  dropped = analytic_every - analytic_subset
  assert abs((every - subset) - dropped) < 0.15 * dropped, (every, subset, dropped)
  computed = np.isin(np.arange(s), np.asarray(queries))
  for spec, layout in (("", "dual"), (",keep_sinks=8", "none")):
    policy = parse_policy(f"sparse_dllm:keep_ratio=0.125{spec}").bind(RunLayout(
        seq_len=s, gen_start=64, block_length=n, steps_per_block=n, cache=layout))
    assert policy.call_flops(config, computed, float(16 + n), kept[None]) == analytic_subset, layout


SMALL = dict(gen_length=8, steps=8, block_length=4, threshold=0.9)


def _refused_runs():
  """(run(params, prompt), message) of each cache combination a policy cannot run."""
  return [
      (lambda p, x: llada.generate(p, x, config=CONFIG, options=llada.LLaDAOptions(**SMALL, cache="dual"),
                                   policy=parse_policy("sparsed")),
       "policy 'sparsed' does not compose with cache='dual'"),
      (lambda p, x: llada.generate(p, x, config=CONFIG, options=llada.LLaDAOptions(**SMALL, cache="prefix"),
                                   policy=parse_policy("d2cache")),
       "policy 'd2cache' does not compose with cache='prefix'"),
      (lambda p, x: llada.generate(p, x, config=CONFIG, policy=parse_policy("sparse_dllm"),
                                   options=llada.LLaDAOptions(**SMALL, cache="dual",
                                                              dual_cache_forwards="steps_per_block")),
       "policy 'sparse_dllm' does not run with dual_cache_forwards='steps_per_block'"),
  ]


@pytest.mark.parametrize("index", range(3))
def test_cache_combinations_a_policy_cannot_run_are_refused_before_compiling(index):
  run, message = _refused_runs()[index]
  traced = dict(driver.TRACE_COUNTS)
  with pytest.raises(ValueError, match=message) as refused:
    run(peaked_params(), prompts())
  assert "\n" not in str(refused.value)
  assert dict(driver.TRACE_COUNTS) == traced


def test_the_sessions_take_sparse_dllm_with_a_cache_mode_and_refuse_the_rest():
  for mode in ("dual_cache", "prefix_cache", "threshold_dual_cache", "threshold_prefix_cache"):
    assert decoding_mode.from_values(mode, policy="sparse_dllm:keep_ratio=0.3").policy == "sparse_dllm:keep_ratio=0.3"
  for policy in ("sparsed", "elastic_cache", "dllm_cache"):
    with pytest.raises(SessionError, match=f"--policy={policy} does not compose with --decoding=dual_cache") as error:
      decoding_mode.from_values("dual_cache", policy=policy)
    assert "\n" not in str(error.value)
  with pytest.raises(SessionError, match="does not run with --dual_cache_forwards=steps_per_block"):
    decoding_mode.from_values("dual_cache", policy="sparse_dllm", dual_cache_forwards="steps_per_block")
