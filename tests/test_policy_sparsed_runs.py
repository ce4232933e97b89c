"""SparseD runs (issue 36): its block-pooled statistic against NumPy, block-sparse attention against dense attention
with the equivalent mask, whole runs at temperature 0 against a replay of the official loop written here (a NumPy
model with a dense token mask per layer, the official step-E rule in NumPy), batch invariance, the skipped work in
XLA's FLOP count, and bad knobs."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlm_jax.config import preset
from dlm_jax.instrument.stats import StatsSpec
from dlm_jax.model import CallInstruments, forward, init_params
from dlm_jax.model.attention import MASK_VALUE, attention
from dlm_jax.model.block_sparse_attention import KeyBlocks, block_sparse_attention
from dlm_jax.model.compute_subset import ComputeSubset
from dlm_jax.policy import cost
from dlm_jax.policy.base import RunLayout
from dlm_jax.policy.registry import parse_policy
from dlm_jax.policy.sparsed import SparseDSettings
from dlm_jax.policy.sparsed_policy import pooled_attention_statistic
from dlm_jax.sampling import dream, llada
from dlm_jax.sampling.schedules import dream_transfer_fractions
from dlm_jax.sampling.run_setup import RunSetup

try:
  from tests import numpy_transformer as ref
except ImportError:  # run from inside tests/
  import numpy_transformer as ref

jax.config.update("jax_default_matmul_precision", "highest")

LP, GEN, STEPS, BLOCK = 6, 8, 8, 4  # S = 14: blocks of 3 leave a partial last block
SETTINGS = "skip=0.2,select=0.3,block_size=3"
END = int(STEPS * 0.2) + 1  # E: the step that chooses the blocks


@functools.lru_cache(maxsize=None)
def _params(name):
  """Random weights; Dream's q/k/v biases made nonzero so the NumPy model's biases are exercised."""
  params = init_params(preset(name), jax.random.key(0))
  if preset(name).qkv_bias:
    attn = params["blocks"]["attn"]
    for i, part in enumerate("qkv"):
      bias = attn[part]["bias"]
      attn[part]["bias"] = 0.3 * jax.random.normal(jax.random.key(10 + i), bias.shape, bias.dtype)
  return params


def _np_forward(params, tokens, config, masks=None):
  """NumPy float64 forward of tiny-llada / tiny-dream: logits [B, S, V] and per layer the post-RoPE (q [B, S, N, H],
  k [B, S, N, H] with kv heads repeated); masks: None or per layer [B, N, S, S] bool, the keys each query sees."""
  c = config
  p = {name: np.asarray(v, np.float64) for name, v in ref._flat(params).items()}
  b, s = tokens.shape
  x = p["embed.embedding"][np.asarray(tokens)]
  positions = np.arange(s, dtype=np.float64)
  group, qk = c.n_heads // c.n_kv_heads, []
  for layer in range(c.n_layers):
    w = lambda name: p[f"blocks.{name}"][layer]  # noqa: E731
    bias = lambda part: w(f"attn.{part}.bias") if c.qkv_bias else 0.0  # noqa: E731
    h = ref._rms(x, w("attn_norm.weight"), c.norm_eps)
    q = (h @ w("attn.q.kernel") + bias("q")).reshape(b, s, c.n_heads, c.head_dim)
    k = (h @ w("attn.k.kernel") + bias("k")).reshape(b, s, c.n_kv_heads, c.head_dim)
    v = (h @ w("attn.v.kernel") + bias("v")).reshape(b, s, c.n_kv_heads, c.head_dim)
    q, k = ref._rope(q, positions, c.rope_theta), ref._rope(k, positions, c.rope_theta)
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    qk.append((q, k))
    scores = np.einsum("bqnh,bknh->bnqk", q, k) / np.sqrt(c.head_dim)
    if masks is not None:
      scores = np.where(masks[layer], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs = probs / probs.sum(-1, keepdims=True)
    x = x + np.einsum("bnqk,bknh->bqnh", probs, v).reshape(b, s, -1) @ w("attn.o.kernel")
    h = ref._rms(x, w("mlp_norm.weight"), c.norm_eps)
    x = x + (ref._silu(h @ w("mlp.gate.kernel")) * (h @ w("mlp.up.kernel"))) @ w("mlp.down.kernel")
  return ref._rms(x, p["final_norm.weight"], c.norm_eps) @ p["lm_head.kernel"], qk


def _softmax(x):
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def _pooled(weights, bs):
  """create_attention_block_mask's score: weights [B, N, rows, cols] -> mean |w| per zero-padded block."""
  b, n, rows, cols = weights.shape
  n_q, n_k = -(-rows // bs), -(-cols // bs)
  padded = np.zeros((b, n, n_q * bs, n_k * bs))
  padded[:, :, :rows, :cols] = weights
  return np.abs(padded).reshape(b, n, n_q, bs, n_k, bs).mean(axis=(3, 5))


def _top(importance, select):
  """The top int(n x select) + 1 blocks of the last axis (ties to the lower block) as a bool mask."""
  n = importance.shape[-1]
  keep = min(max(1, int(n * select) + 1), n)
  order = np.argsort(-importance, axis=-1, kind="stable")[..., :keep]
  mask = np.zeros(importance.shape, bool)
  np.put_along_axis(mask, order, True, axis=-1)
  return mask


def _official_blocks(q, k, bs, select, new_generation, divisor):
  """The step-E branch of the official attention: q, k [B, S, N, H] -> fine_mask [B, N, nQb, nKb]."""
  q, k = np.moveaxis(q, 2, 1), np.moveaxis(k, 2, 1)
  s = q.shape[2]
  n_blocks = -(-s // bs)
  fine = np.zeros((q.shape[0], q.shape[1], n_blocks, n_blocks), bool)
  last = None
  for idx in range(n_blocks):
    if (s - idx * bs <= new_generation or idx == n_blocks - 1) and last is None:
      last = idx
    weights = _softmax(np.einsum("bnqh,bnkh->bnqk", q[:, :, idx * bs:(idx + 1) * bs], k) / np.sqrt(divisor))
    fine[:, :, idx] = _top(_pooled(weights, bs), select)[:, :, 0]
  fine[:, :, :, last:] = False
  for idx in range(n_blocks):
    weights = _softmax(np.einsum("bnqh,bnkh->bnqk", q[:, :, idx * bs:(idx + 1) * bs], k[:, :, last * bs:])
                       / np.sqrt(divisor))
    fine[:, :, idx, last:] |= _top(_pooled(weights, bs), select)[:, :, 0]
  return fine


def _token_mask(fine, s, bs):
  """customize_mask: key j visible to query i iff fine[b, h, i // bs, j // bs]."""
  index = np.arange(s) // bs
  return fine[:, :, index][:, :, :, index]


def _replay(params, config, prompt, family, scale):
  """The official loop at temperature 0 with SparseD (skip 0.2, select 0.3, block_size 3): (tokens [B, S],
  decode step [B, GEN], the chosen blocks per layer [L, B, N, nQb, nKb]). Positions decoded per step: LLaDA's
  get_num_transfer_tokens per block; Dream's int(M̄·(1 − s/t)) with its float32 timesteps
  (`schedules.dream_transfer_fractions`, tested bit for bit elsewhere)."""
  mask_id, bs, select = config.mask_token_id, 3, 0.3
  x = np.concatenate([np.asarray(prompt), np.full((prompt.shape[0], GEN), mask_id)], axis=1)
  s = x.shape[1]
  divisor = config.n_heads if scale == "num_heads" else config.head_dim
  decoded, masks, fine = np.full((x.shape[0], GEN), -1), None, None
  per_block, fractions = STEPS * BLOCK // GEN, dream_transfer_fractions(STEPS, 1e-3)
  for step in range(STEPS):
    if family == "llada":
      count = BLOCK // per_block + (step % per_block < BLOCK % per_block)
    else:
      mean = np.float32(np.sum(x == mask_id) / x.shape[0])
      count = int(np.floor(mean if step == STEPS - 1 else np.float32(mean * fractions[step])))
    logits, qk = _np_forward(params, x, config, masks)
    if step == END:
      fine = [_official_blocks(q, k, bs, select, STEPS, divisor) for q, k in qk]
      masks = [_token_mask(f, s, bs) for f in fine]
    if family == "dream":
      logits = np.concatenate([logits[:, :1], logits[:, :-1]], axis=1)
    probs = _softmax(logits)
    x0, p0 = probs.argmax(-1), probs.max(-1)
    masked = x == mask_id
    if family == "llada":
      p0 = np.where(np.arange(s) >= LP + (step // per_block + 1) * BLOCK, -np.inf, p0)
    confidence = np.where(masked, p0, -np.inf)
    for row in range(x.shape[0]):
      chosen = np.argsort(-confidence[row], kind="stable")[:count]
      x[row, chosen] = x0[row, chosen]
      decoded[row, chosen - LP] = step
  return x, decoded, np.stack(fine)


@functools.lru_cache(maxsize=None)
def _prompt():
  return np.asarray(jax.random.randint(jax.random.key(1), (2, LP), 3, 200))


def _run(family, scale, prompt, batch_invariant=False):
  name = "tiny-llada" if family == "llada" else "tiny-dream"
  config, params = preset(name), _params(name)
  boundary = "gen_length" if family == "llada" else "steps"  # the official scripts' (equal here: GEN = STEPS)
  policy = parse_policy(f"sparsed:{SETTINGS},score_scale={scale},boundary_from={boundary}")
  if family == "llada":
    options = llada.LLaDAOptions(gen_length=GEN, steps=STEPS, block_length=BLOCK)
    return llada.generate(params, prompt, config=config, options=options,
                          setup=RunSetup(policy=policy, batch_invariant=batch_invariant))
  options = dream.DreamOptions(gen_length=GEN, steps=STEPS, alg="maskgit_plus")
  return dream.diffusion_generate(params, prompt, config=config, options=options,
                                  setup=RunSetup(policy=policy, batch_invariant=batch_invariant))


@pytest.mark.parametrize("family, scale", [("llada", "num_heads"), ("dream", "head_dim")])
def test_a_run_is_the_official_loop(family, scale):
  """Each family with its official score scale (both values of the flag); Dream batch-invariant (the program
  the batch test shares)."""
  prompt = _prompt()
  name = "tiny-llada" if family == "llada" else "tiny-dream"
  tokens, decoded, fine = _replay(_params(name), preset(name), prompt, family, scale)
  trace = _run(family, scale, prompt, batch_invariant=family == "dream")
  np.testing.assert_array_equal(np.asarray(trace.tokens), tokens)
  np.testing.assert_array_equal(np.asarray(trace.decode_step), decoded)
  assert int(trace.nfe) == STEPS
  record = np.asarray(trace.policy_record)  # [steps, B, L, N, nQb, m]
  n_blocks = fine.shape[-1]
  for step in range(STEPS):
    kept = np.zeros(record.shape[1:-1] + (n_blocks + 1,), bool)
    np.put_along_axis(kept, record[step], True, axis=-1)
    expected = np.zeros_like(kept[..., :-1]) if step < END else np.moveaxis(fine, 0, 1)
    np.testing.assert_array_equal(kept[..., :-1], expected, err_msg=f"step {step}")
  keys = np.asarray(trace.keys_read)  # [steps, B]: keys per query, mean over layers, heads and queries
  visible = np.stack([_token_mask(f, LP + GEN, 3) for f in fine]).sum(-1).mean(axis=(0, 2, 3))  # [B]
  np.testing.assert_array_equal(keys[:END + 1], LP + GEN)
  np.testing.assert_allclose(keys[END + 1:], np.broadcast_to(visible, keys[END + 1:].shape), rtol=1e-6)
  assert (visible < LP + GEN).all()


def test_a_row_decodes_alone_as_in_its_batch():
  prompt = _prompt()
  both = _run("dream", "head_dim", prompt, batch_invariant=True)  # the replay test's program
  for row in range(2):
    alone = _run("dream", "head_dim", prompt[row:row + 1], batch_invariant=True)
    np.testing.assert_array_equal(alone.tokens[0], both.tokens[row])
    np.testing.assert_array_equal(alone.policy_record[:, 0], both.policy_record[:, row])


def test_the_pooled_statistic_is_the_numpy_one():
  config, params = preset("tiny-llada"), _params("tiny-llada")
  tokens = jnp.asarray(np.concatenate([_prompt(), np.full((2, GEN), config.mask_token_id)], axis=1))
  settings = SparseDSettings(select=0.3, block_size=3)
  name = pooled_attention_statistic(settings, 2)
  weights = np.ones((2, 2, LP + GEN), np.float32)  # group 0 is not the statistic's (it reads the last group)
  weights[:, 1] = np.random.default_rng(0).random((2, LP + GEN))
  run = jax.jit(lambda p, t, w: forward(p, t, config=config,
                                        instruments=CallInstruments(stats_spec=StatsSpec(extra=(name,), query_groups=2),
                                                                    query_weights=w)).stats[name])
  got = np.asarray(run(params, tokens, jnp.asarray(weights)))  # [L, B, Q, 2, N, nQb, nKb]
  _, qk = _np_forward(params, tokens, config)
  for layer, (q, k) in enumerate(qk):
    scores = np.einsum("bqnh,bknh->bnqk", q, k) / np.sqrt(config.n_heads)
    row = weights[:, 1][:, None, :, None]
    tail = np.where(np.arange(LP + GEN) >= 2 * 3, scores, -np.inf)  # keys from block g = 2 on
    np.testing.assert_allclose(got[layer, :, 1, 0], _pooled(row * _softmax(scores), 3), rtol=2e-5, atol=1e-7)
    np.testing.assert_allclose(got[layer, :, 1, 1], _pooled(row * _softmax(tail), 3), rtol=2e-5, atol=1e-7)
  assert not got[:, :, 0].any()
  weights[:, 1] = 0.0  # a last group without weight computes nothing
  assert not np.asarray(run(params, tokens, jnp.asarray(weights))).any()


@pytest.mark.parametrize("impl", ["dense", "chunked"])
def test_block_sparse_attention_is_dense_attention_under_the_mask(impl):
  rng = np.random.default_rng(0)
  b, s, n, kv, h, bs = 2, 18, 4, 2, 8, 5
  q, k, v = (rng.standard_normal(shape).astype(np.float32) for shape in ((b, s, n, h), (b, s, kv, h), (b, s, kv, h)))
  fine = rng.random((b, n, 4, 4)) < 0.5
  fine[..., 3] |= ~fine.any(-1)  # the partial last block (positions 15..17) is kept where nothing else is
  m = int(fine.sum(-1).max())
  index = np.sort(np.where(fine, np.arange(4), 4), axis=-1)[..., :m].astype(np.int32)
  key_bias = np.where(rng.random((b, 1, s)) < 0.2, MASK_VALUE, 0.0).astype(np.float32)
  pairwise = rng.standard_normal((b, n, s, s)).astype(np.float32)
  weights = rng.random((b, 3, s)).astype(np.float32)
  masked = pairwise + np.where(_token_mask(fine, s, bs), 0.0, MASK_VALUE).astype(np.float32)
  expected = attention(q, k, v, scale=0.3, key_bias=key_bias, pairwise_bias=masked, query_weights=weights,
                       with_incoming=True, impl=impl, query_chunk=4)
  got = jax.jit(lambda q, k, v, i: block_sparse_attention(q, k, v, KeyBlocks(i, bs), scale=0.3, key_bias=key_bias,
                                                          pairwise_bias=pairwise, query_weights=weights,
                                                          with_incoming=True))(q, k, v, index)
  np.testing.assert_allclose(got[0], expected[0], atol=2e-6)
  np.testing.assert_allclose(got[1], expected[1], atol=4e-6)


def test_the_skipped_blocks_leave_the_flop_count():
  """One layer, dense attention paths: XLA's cost analysis counts a loop body once, so neither program loops. Half
  the query blocks' second slot is padding (a pass-one block at or after g is dropped): XLA still counts every
  slot, and so does the policy's own count of the call from what the trace records (`call_flops`: the kept
  blocks, the keys read)."""
  config = dataclasses.replace(preset("tiny-llada"), n_layers=1)
  params = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))  # shapes only: nothing runs
  s, bs, m = 128, 16, 2
  tokens = jnp.zeros((1, s), jnp.int32)
  slots = np.broadcast_to(np.arange(m), (config.n_heads, s // bs, m)).copy()
  slots[:, ::2, 1] = s // bs
  index = jnp.asarray(slots, jnp.int32)[None, None]

  def flops(fn, *args):
    return jax.jit(fn).lower(*args).compile().cost_analysis()["flops"]

  dense = dict(config=config, return_hidden=True, attention_impl="dense")
  full = flops(lambda p, t: forward(p, t, **dense).hidden, params, tokens)
  sparse = flops(lambda p, t, i: forward(p, t, subset=ComputeSubset(None, key_blocks=KeyBlocks(i, bs)),
                                         **dense).hidden, params, tokens, index)
  analytic_full, analytic_sparse = cost.trunk_flops(config, s, s), cost.block_sparse_flops(config, s, bs, m)
  assert abs(full / analytic_full - 1) < 0.1 and abs(sparse / analytic_sparse - 1) < 0.1, (full, sparse)
  skipped = analytic_full - analytic_sparse  # 3/4 of the attention matmuls; the rest is the softmax's elementwise work
  assert abs((full - sparse) - skipped) < 0.15 * skipped, (full, sparse, skipped)
  policy = parse_policy(f"sparsed:block_size={bs}").bind(RunLayout(seq_len=s, gen_start=64, block_length=64,
                                                                   steps_per_block=64))
  computed = np.ones(s, bool)
  assert policy.call_flops(config, computed, 1.5 * bs, slots[None]) == analytic_sparse
  assert policy.call_flops(config, computed, float(s), slots[None]) == analytic_full


@pytest.mark.parametrize("text, message", [
    ("sparsed:select=0", r"sparsed select must be a number in \(0, 1\], got 0.0"),
    ("sparsed:select=1.5", r"sparsed select must be a number in \(0, 1\], got 1.5"),
    ("sparsed:block_size=0", "sparsed block_size must be an integer >= 1, got 0"),
    ("sparsed:skip=1.0", r"sparsed skip must be a number in \[0, 1\), got 1.0"),
    ("sparsed:skip=-0.5", r"sparsed skip must be a number in \[0, 1\), got -0.5"),
    ("sparsed:score_scale=sqrt", "sparsed score_scale must be 'num_heads' or 'head_dim'"),
])
def test_bad_knobs_are_refused_in_one_line(text, message):
  with pytest.raises(ValueError, match=message) as error:
    parse_policy(text)
  assert "\n" not in str(error.value)


def test_runs_sparsed_cannot_take_are_refused():
  params = jax.eval_shape(lambda: init_params(preset("tiny-llama"), jax.random.key(0)))  # refused before it runs
  from dlm_jax.sampling import autoregressive
  with pytest.raises(ValueError, match="runs with the samplers whose every call reads the whole sequence"):
    autoregressive.generate(params, _prompt(), config=preset("tiny-llama"),
                            setup=RunSetup(policy=parse_policy("sparsed")))
  with pytest.raises(ValueError, match="policy sparsed runs with the llada, dream samplers"):
    parse_policy("sparsed").check(None, "block_diffusion")
