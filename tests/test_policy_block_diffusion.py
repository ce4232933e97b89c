"""Sparse-dLLM with block diffusion's exact KV cache (issue 36 item 3; our composition, no official code for
LLaDA2): a whole batched run at temperature 0 against a replay written here (a Python loop over the float64
block-causal NumPy forward of tests/test_block_diffusion.py with its own per-layer cache: the prefill, each
block's decoding calls — at calls 0 and 1 over every cached key, call 1 scoring them, from call 2 over the kept
keys of the prefix and the block's own — and the commits, which read every key), the policy's FLOP count of each
call and XLA's against an analytic count written here, a row in the batch-invariant mode bitwise as alone,
keep_ratio 1 giving the plain sampler's tokens, the prefix top-k replay against `torch.topk`, and the runs it
cannot take refused in one line before compiling.

The tiny block-causal LLaDA of tests/test_block_diffusion.py (blocks of 8): prompts of 11 tokens put one block in
the prefill and the prompt's tail in the first decoded block; G = 16 gives T = 32, three decoded blocks whose
prefixes of 8, 16 and 24 keys keep 4, 8 and 12."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dlm_jax import model
from dlm_jax.core.attention_bias import AttentionBias
from dlm_jax.instrument.hook_spec import Capture, Hooks
from dlm_jax.instrument.stats import NO_STATS
from dlm_jax.model import Compute, KVCache
from dlm_jax.model.forward_inputs import CallInstruments, Readout
from dlm_jax.policy import sparse_dllm
from dlm_jax.policy.base import Decision, RunLayout
from dlm_jax.policy.registry import parse_policy
from dlm_jax.sampling import block_diffusion as bd
from dlm_jax.sampling import driver, policy_call
from dlm_jax.sampling.run_setup import RunSetup

try:
  from tests.numpy_transformer import trunk_flops
  from tests.test_block_diffusion import BLOCK, CONFIG, MASK, np_forward, peaked_params, prompts, reference_decide
except ImportError:  # run from inside tests/
  from numpy_transformer import trunk_flops
  from test_block_diffusion import BLOCK, CONFIG, MASK, np_forward, peaked_params, prompts, reference_decide

jax.config.update("jax_default_matmul_precision", "highest")

LP, GEN, TAU, RATIO = 11, 16, 0.9, 0.5
TOTAL = -(-(LP + GEN) // BLOCK) * BLOCK
OPTIONS = bd.BlockDiffusionOptions(gen_length=GEN, block_length=BLOCK, steps=BLOCK, threshold=TAU, eos_stop=False)
SPARSE = f"sparse_dllm:keep_ratio={RATIO},tie_break=lowest_position"
N_MAX = int((TOTAL - BLOCK) * RATIO)
"""The kept-key slots of every block (the last block's count; an earlier block's unused slots are padding)."""


@functools.lru_cache(maxsize=None)
def generate(policy, rows=(0, 1), batch_invariant=False):
  """The prompts `rows` in one batch under `policy` ("none": the plain sampler)."""
  setup = RunSetup(policy=parse_policy(policy), batch_invariant=batch_invariant)
  return bd.generate(peaked_params(), prompts(2, seed=2, length=LP)[list(rows)], config=CONFIG, options=OPTIONS,
                     setup=setup)


def np_kept(queries, kv, start, margins):
  """Sparse-dLLM's kept keys per layer: the head mean of the block-mean post-RoPE query . every cached key, the
  prefix [0, start) max-pooled (kernel 3, -inf padding), the top int(start x RATIO) (ties: lowest position first),
  ascending. margins collects the gap at the cut between distinct pooled scores."""
  group = CONFIG.n_heads // CONFIG.n_kv_heads
  kept = []
  for layer in range(CONFIG.n_layers):
    q_mean = queries[layer].mean(axis=0)  # [N, H]
    k = kv[layer][0]
    scores = np.mean([k[:start, h // group] @ q_mean[h] for h in range(CONFIG.n_heads)], axis=0)
    padded = np.concatenate([[-np.inf], scores, [-np.inf]])
    pooled = np.max([padded[j:j + start] for j in range(3)], axis=0)
    order = sorted(range(start), key=lambda j: (-pooled[j], j))
    n = int(start * RATIO)
    if 0 < n < start and pooled[order[n - 1]] != pooled[order[n]]:
      margins.append(pooled[order[n - 1]] - pooled[order[n]])
    kept.append(np.sort(order[:n]))
  return kept


def replay(prompt, margins):
  """One row of block diffusion with the cache under Sparse-dLLM ("llada2" rule, τ = TAU, BLOCK steps per
  block): (tokens [T], decode_step [T − LP], reads: the keys each call read, kept {call: [L][n]} for the calls
  after which the policy holds the block's kept keys — its calls from 1 on and its commit —, calls: per call
  (start, stop, slots), its queries [start, stop) and the key slots the program gives each of them: all T
  cached positions, the unseen ones masked, at a call that reads every key it sees, else the N_MAX kept-key
  slots and the block's own)."""
  x = np.concatenate([prompt, np.full(TOTAL - LP, MASK)]).astype(np.int64)
  decode_step = np.full(TOTAL - LP, -1)
  first, n_blocks = LP // BLOCK, TOTAL // BLOCK
  _, kv, _ = np_forward(x, 0, first * BLOCK)  # the prefill
  reads, kept_at, calls = [first * BLOCK], {}, [(0, first * BLOCK, TOTAL)]
  for block in range(first, n_blocks):
    s, e = block * BLOCK, (block + 1) * BLOCK
    kept = None
    for j in range(BLOCK):
      candidates = x[s:e] == MASK
      if not candidates.any():
        break
      queries = []
      logits, new_kv, _ = np_forward(x, s, e, kv, keys=None if j < 2 else kept, queries_out=queries)
      if j == 1:
        kept = np_kept(queries, new_kv, s, margins)
      if j >= 1:
        kept_at[len(reads)] = kept
      reads.append(e if j < 2 else int(s * RATIO) + BLOCK)
      calls.append((s, e, TOTAL if j < 2 else N_MAX + BLOCK))
      x0, chosen = reference_decide(logits, candidates, "llada2", TAU, 1, margins)
      for i in chosen:
        x[s + i] = x0[i]
        decode_step[s + i - LP] = len(reads) - 1
    if block < n_blocks - 1:
      _, kv, _ = np_forward(x, s, e, kv)  # the commit: every key, the block's keys and values stored
      if kept is not None:
        kept_at[len(reads)] = kept
      reads.append(e)
      calls.append((s, e, TOTAL))
  return x, decode_step, reads, kept_at, calls


def test_block_diffusion_under_sparse_dllm_is_the_replay():
  """Both rows in one batch (a row waits while the other finishes its block): each row's tokens, decode order,
  calls, the keys each call read and the kept keys of every layer in every block are those of its replay
  alone, and the policy's FLOP count of each call (`call_flops`, as experiments.policy_sweep reads it from the
  trace) is the analytic count of what the call computes."""
  trace = generate(SPARSE)
  nfe = int(trace.nfe)
  active = np.asarray(trace.active_rows)[:nfe]
  shared = ~active.any(axis=1)  # the prefill and the commits: every row's
  assert (active.any(axis=1) & ~active.all(axis=1)).any(), "no row waited for the batch"
  policy = parse_policy(SPARSE).bind(RunLayout(seq_len=TOTAL, gen_start=LP, block_length=BLOCK,
                                               steps_per_block=BLOCK, cache="block"))
  margins, subset_calls = [], 0
  for row, prompt in enumerate(prompts(2, seed=2, length=LP)):
    tokens, decode_step, reads, kept_at, calls = replay(prompt, margins)
    mine = active[:, row] | shared
    own = np.cumsum(mine) - 1  # the batch's call -> the row's own call
    np.testing.assert_array_equal(np.asarray(trace.tokens)[row], tokens, err_msg=f"row {row}")
    np.testing.assert_array_equal(own[np.asarray(trace.decode_step)[row]], decode_step, err_msg=f"row {row}")
    keys = np.asarray(trace.keys_read)[:nfe, row][mine]
    np.testing.assert_array_equal(keys, reads, err_msg=f"row {row}")
    record = np.asarray(trace.policy_record)[:nfe, row][mine]  # [calls, L, n_max]
    for call, kept in kept_at.items():
      for layer, layer_kept in enumerate(kept):
        expected = np.full(record.shape[-1], TOTAL)
        expected[:len(layer_kept)] = layer_kept
        np.testing.assert_array_equal(record[call, layer], expected, err_msg=f"row {row} call {call} layer {layer}")
    computed = np.asarray(trace.computed_positions)[:nfe, row][mine]
    for call, (start, stop, slots) in enumerate(calls):
      np.testing.assert_array_equal(np.flatnonzero(computed[call]), np.arange(start, stop), err_msg=f"call {call}")
      flops = policy.call_flops(CONFIG, computed[call], float(keys[call]), record[call])
      assert flops == trunk_flops(CONFIG, stop - start, slots), (row, call, flops)
    assert np.all(tokens != MASK)
    subset_calls += sum(slots != TOTAL for _, _, slots in calls)
  assert min(margins) > 1e-4, "a decision of the replay is within rounding of flipping: change the case"
  assert subset_calls >= 4, f"{subset_calls} calls over the kept keys: the subset path is barely exercised"


def test_a_row_decodes_alone_as_in_its_batch_in_the_batch_invariant_mode():
  """`batch_invariant=True`: each row's tokens, decode order, computed positions and kept keys in the batch of two
  (where a row waits for the other) are bitwise those it gets alone."""
  both = generate(SPARSE, batch_invariant=True)
  active = np.asarray(both.active_rows)[:int(both.nfe)]
  assert (active.any(axis=1) & ~active.all(axis=1)).any(), "no row waited for the batch"
  for row in range(2):
    alone = generate(SPARSE, rows=(row,), batch_invariant=True)
    mine = active[:, row] | ~active.any(axis=1)
    own = np.cumsum(mine) - 1
    np.testing.assert_array_equal(np.asarray(alone.tokens)[0], np.asarray(both.tokens)[row])
    np.testing.assert_array_equal(np.asarray(alone.decode_step)[0], own[np.asarray(both.decode_step)[row]])
    for field in ("computed_positions", "policy_record"):
      np.testing.assert_array_equal(np.asarray(getattr(alone, field))[:int(alone.nfe), 0],
                                    np.asarray(getattr(both, field))[:int(both.nfe), row][mine], err_msg=field)


def test_the_dropped_keys_leave_xlas_flop_count():
  """XLA's cost analysis of a decoding call of one block (`policy_call.family_cache_forward`; one layer, dense
  attention, 256 positions so that attention weighs; the decision's `full` a constant, so that XLA keeps the branch
  taken): within 10% of the analytic count of what it computes — all S cached positions per query at a call the
  policy makes full, the static kept-key slots and the block's own at a subset call — and the policy's own count
  of the same calls from what the trace records (the block's queries, the keys they see or read, the kept keys)
  is that analytic count."""
  config, s_len, start = CONFIG.replace(n_layers=1), 256, 32
  n_max, count = sparse_dllm.keep_count(s_len, BLOCK, RATIO), int(start * RATIO)
  # The cost analysis reads shapes only: the weights and the cache as shapes, no random-number program compiled.
  params = jax.eval_shape(lambda: model.init_params(config, jax.random.key(0)))
  cache = jax.eval_shape(lambda: KVCache.zeros(config, 1, s_len))
  tokens, queries = jnp.zeros((1, BLOCK), jnp.int32), (start + jnp.arange(BLOCK, dtype=jnp.int32))[None]
  kept = np.full((1, n_max), s_len, np.int32)
  kept[0, :count] = np.arange(0, start, 2)
  instruments = CallInstruments(bias=AttentionBias(), stats_spec=NO_STATS)

  def flops(full):
    def call(p, t, c):
      def run(t, *, positions, instruments, readout, **fields):
        return model.forward(p, t, config=config, positions=positions, instruments=instruments, readout=readout,
                             compute=Compute(attention_impl="dense", **fields))

      decision = Decision(full=jnp.asarray(full), queries=queries, keys=jnp.asarray(kept)[None])
      return policy_call.family_cache_forward(run, decision, c, jnp.asarray(start, jnp.int32), t, queries,
                                              instruments, Readout(hidden=True)).hidden
    return jax.jit(call).lower(params, tokens, cache).compile().cost_analysis()["flops"]

  policy = parse_policy(SPARSE).bind(RunLayout(seq_len=s_len, gen_start=LP, block_length=BLOCK,
                                               steps_per_block=BLOCK, cache="block"))
  computed = (np.arange(s_len) >= start) & (np.arange(s_len) < start + BLOCK)
  for full, slots, keys in ((True, s_len, start + BLOCK), (False, n_max + BLOCK, count + BLOCK)):
    analytic, measured = trunk_flops(config, BLOCK, slots), flops(full)
    assert abs(measured / analytic - 1) < 0.1, (full, measured, analytic)
    assert policy.call_flops(config, computed, float(keys), kept) == analytic, full


def test_every_key_kept_is_the_plain_sampler():
  """keep_ratio 1 keeps the whole prefix: the tokens, decode order and NFE of the sampler without a policy."""
  every, plain = generate("sparse_dllm:keep_ratio=1.0,tie_break=lowest_position"), generate("none")
  np.testing.assert_array_equal(np.asarray(every.tokens), np.asarray(plain.tokens))
  np.testing.assert_array_equal(np.asarray(every.decode_step), np.asarray(plain.decode_step))
  assert int(every.nfe) == int(plain.nfe)


def test_the_prefix_selection_with_torchs_ties_is_torch_topk():
  """tie_break "torch_cpu": the kept keys of each block are the set `torch.topk` returns on the max-pooled scores
  of the block's prefix (tie-heavy scores; the nth_element path)."""
  rng = np.random.default_rng(0)
  scores = np.round(rng.normal(size=(3, TOTAL)), 1).astype(np.float32)
  settings = sparse_dllm.SparseDLLMSettings(keep_ratio=0.3)
  keep = jax.jit(lambda x, start: sparse_dllm.keep_prefix_positions(x, start, BLOCK, settings))
  n_max = sparse_dllm.keep_count(TOTAL, BLOCK, 0.3)
  for start in (8, 16, 24):
    padded = np.pad(scores[:, :start], ((0, 0), (1, 1)), constant_values=-np.inf)
    pooled = np.max([padded[:, j:j + start] for j in range(3)], axis=0)
    expected = np.sort(torch.topk(torch.from_numpy(pooled), int(start * 0.3)).indices.numpy(), axis=-1)
    expected = np.pad(expected, ((0, 0), (0, n_max - expected.shape[1])), constant_values=TOTAL)
    np.testing.assert_array_equal(np.asarray(keep(jnp.asarray(scores), start)), expected, err_msg=f"{start}")


@pytest.mark.parametrize("policy, options, setup, message", [
    ("dkv_cache", OPTIONS, {}, "policy 'dkv_cache' does not run with block diffusion"),
    ("sparse_dllm", bd.BlockDiffusionOptions(gen_length=GEN, block_length=BLOCK, steps=BLOCK, cache=False,
                                             eos_stop=False), {}, "with cache=True"),
    ("sparse_dllm", OPTIONS, {"hooks": Hooks(captures=(Capture("hook_resid_post"),))}, "does not run with hooks"),
])
def test_runs_it_cannot_take_are_refused_before_compiling(policy, options, setup, message):
  traced = dict(driver.TRACE_COUNTS)
  with pytest.raises(ValueError, match=message) as refused:
    bd.generate(peaked_params(), prompts(1, seed=2, length=LP), config=CONFIG, options=options,
                setup=RunSetup(policy=parse_policy(policy), **setup))
  assert "\n" not in str(refused.value)
  assert dict(driver.TRACE_COUNTS) == traced
