"""Sparse-dLLM with block diffusion's exact KV cache (issue 36 item 3; our composition, no official code for
LLaDA2): a whole batched run at temperature 0 against a replay written here (a Python loop over a float64
block-causal NumPy forward with its own per-layer cache: the prefill, each block's decoding calls — at calls 0
and 1 over every cached key, call 1 scoring them, from call 2 over the kept keys of the prefix and the block's
own — and the commits, which read every key), keep_ratio 1 giving the plain sampler's tokens, the prefix top-k
replay against `torch.topk`, and the runs it cannot take refused in one line before compiling.

The tiny block-causal LLaDA of tests/test_block_diffusion.py (blocks of 8): prompts of 11 tokens put one block in
the prefill and the prompt's tail in the first decoded block; G = 16 gives T = 32, three decoded blocks whose
prefixes of 8, 16 and 24 keys keep 4, 8 and 12."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dlm_jax.instrument.hook_spec import Capture, Hooks
from dlm_jax.policy import sparse_dllm
from dlm_jax.policy.registry import parse_policy
from dlm_jax.sampling import block_diffusion as bd
from dlm_jax.sampling import driver
from dlm_jax.sampling.run_setup import RunSetup

try:
  from tests.test_block_diffusion import BLOCK, CONFIG, MASK, _np_params, _rms, _rope, peaked_params, prompts
  from tests.test_block_diffusion import reference_decide
except ImportError:  # run from inside tests/
  from test_block_diffusion import BLOCK, CONFIG, MASK, _np_params, _rms, _rope, peaked_params, prompts
  from test_block_diffusion import reference_decide

jax.config.update("jax_default_matmul_precision", "highest")

LP, GEN, TAU, RATIO = 11, 16, 0.9, 0.5
TOTAL = -(-(LP + GEN) // BLOCK) * BLOCK
OPTIONS = bd.BlockDiffusionOptions(gen_length=GEN, block_length=BLOCK, steps=BLOCK, threshold=TAU, eos_stop=False)
SPARSE = f"sparse_dllm:keep_ratio={RATIO},tie_break=lowest_position"


@functools.lru_cache(maxsize=None)
def generate(policy):
  """Both prompts in one batch under `policy` ("none": the plain sampler)."""
  setup = RunSetup(policy=parse_policy(policy))
  return bd.generate(peaked_params(), prompts(2, seed=2, length=LP), config=CONFIG, options=OPTIONS, setup=setup)


def np_call(x, start, stop, kv, keys=None, queries_out=None):
  """One row's model call on the queries [start, stop): block-causal attention (query i sees key j iff
  j // BLOCK <= i // BLOCK) over the cache kv (per layer (K, V) [T, K, H] after RoPE; None: nothing cached),
  restricted with keys (per layer the cached positions read) to those and [start, stop). Returns (logits
  [stop − start, V], the cache with the call's keys and values written); queries_out collects each layer's
  post-RoPE queries [stop − start, N, H]."""
  c, p = CONFIG, _np_params()
  query = np.arange(start, stop)
  group = c.n_heads // c.n_kv_heads
  h_x = p["embed.embedding"][x[start:stop]]
  new_kv = []
  for layer in range(c.n_layers):
    w = lambda name: p[f"blocks.{name}"][layer]  # noqa: B023
    h = _rms(h_x, w("attn_norm.weight"))
    q = _rope((h @ w("attn.q.kernel")).reshape(-1, c.n_heads, c.head_dim), query.astype(np.float64))
    k = _rope((h @ w("attn.k.kernel")).reshape(-1, c.n_kv_heads, c.head_dim), query.astype(np.float64))
    v = (h @ w("attn.v.kernel")).reshape(-1, c.n_kv_heads, c.head_dim)
    keys_l = np.zeros((TOTAL, c.n_kv_heads, c.head_dim)) if kv is None else kv[layer][0].copy()
    values_l = np.zeros_like(keys_l) if kv is None else kv[layer][1].copy()
    keys_l[start:stop], values_l[start:stop] = k, v
    new_kv.append((keys_l, values_l))
    if queries_out is not None:
      queries_out.append(q)
    visible = np.arange(TOTAL)[None, :] // BLOCK <= query[:, None] // BLOCK
    if keys is not None:
      read = np.isin(np.arange(TOTAL), keys[layer]) | ((np.arange(TOTAL) >= start) & (np.arange(TOTAL) < stop))
      visible = visible & read[None, :]
    head_keys, head_values = np.repeat(keys_l, group, axis=1), np.repeat(values_l, group, axis=1)
    scores = np.where(visible[None], np.einsum("tnh,snh->nts", q, head_keys) / np.sqrt(c.head_dim), -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    h_x = h_x + np.einsum("nts,snh->tnh", probs, head_values).reshape(-1, c.n_heads * c.head_dim) @ w("attn.o.kernel")
    h = _rms(h_x, w("mlp_norm.weight"))
    gate = h @ w("mlp.gate.kernel")
    h_x = h_x + ((gate / (1 + np.exp(-gate))) * (h @ w("mlp.up.kernel"))) @ w("mlp.down.kernel")
  return _rms(h_x, p["final_norm.weight"]) @ p["lm_head.kernel"], new_kv


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
  after which the policy holds the block's kept keys — its calls from 1 on and its commit —, subset: the number
  of calls over the kept keys)."""
  x = np.concatenate([prompt, np.full(TOTAL - LP, MASK)]).astype(np.int64)
  decode_step = np.full(TOTAL - LP, -1)
  first, n_blocks = LP // BLOCK, TOTAL // BLOCK
  _, kv = np_call(x, 0, first * BLOCK, None)  # the prefill
  reads, kept_at, subset = [first * BLOCK], {}, 0
  for block in range(first, n_blocks):
    s, e = block * BLOCK, (block + 1) * BLOCK
    kept = None
    for j in range(BLOCK):
      candidates = x[s:e] == MASK
      if not candidates.any():
        break
      queries = []
      logits, new_kv = np_call(x, s, e, kv, None if j < 2 else kept, queries)
      if j == 1:
        kept = np_kept(queries, new_kv, s, margins)
      if j >= 1:
        kept_at[len(reads)] = kept
      reads.append(e if j < 2 else int(s * RATIO) + BLOCK)
      subset += j >= 2
      x0, chosen = reference_decide(logits, candidates, "llada2", TAU, 1, margins)
      for i in chosen:
        x[s + i] = x0[i]
        decode_step[s + i - LP] = len(reads) - 1
    if block < n_blocks - 1:
      _, kv = np_call(x, s, e, kv)  # the commit: every key, the block's keys and values stored
      if kept is not None:
        kept_at[len(reads)] = kept
      reads.append(e)
  return x, decode_step, reads, kept_at, subset


def test_block_diffusion_under_sparse_dllm_is_the_replay():
  """Both rows in one batch (a row waits while the other finishes its block): each row's tokens, decode order,
  calls, the keys each call read and the kept keys of every layer in every block are those of its replay
  alone."""
  trace = generate(SPARSE)
  nfe = int(trace.nfe)
  active = np.asarray(trace.active_rows)[:nfe]
  shared = ~active.any(axis=1)  # the prefill and the commits: every row's
  assert (active.any(axis=1) & ~active.all(axis=1)).any(), "no row waited for the batch"
  margins, subset_calls = [], 0
  for row, prompt in enumerate(prompts(2, seed=2, length=LP)):
    tokens, decode_step, reads, kept_at, subset = replay(prompt, margins)
    mine = active[:, row] | shared
    own = np.cumsum(mine) - 1  # the batch's call -> the row's own call
    np.testing.assert_array_equal(np.asarray(trace.tokens)[row], tokens, err_msg=f"row {row}")
    np.testing.assert_array_equal(own[np.asarray(trace.decode_step)[row]], decode_step, err_msg=f"row {row}")
    np.testing.assert_array_equal(np.asarray(trace.keys_read)[:nfe, row][mine], reads, err_msg=f"row {row}")
    record = np.asarray(trace.policy_record)[:nfe, row][mine]  # [calls, L, n_max]
    for call, kept in kept_at.items():
      for layer, layer_kept in enumerate(kept):
        expected = np.full(record.shape[-1], TOTAL)
        expected[:len(layer_kept)] = layer_kept
        np.testing.assert_array_equal(record[call, layer], expected, err_msg=f"row {row} call {call} layer {layer}")
    assert np.all(tokens != MASK)
    subset_calls += subset
  assert min(margins) > 1e-4, "a decision of the replay is within rounding of flipping: change the case"
  assert subset_calls >= 4, f"{subset_calls} calls over the kept keys: the subset path is barely exercised"


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
