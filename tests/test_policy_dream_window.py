"""Compute policies on Elastic-Cache's Dream decoding (`dream.elastic_cache_options()`, sampler family
`dream_window`: threshold 0.9 over a sliding window of masks, EOS truncation, no blocks) other than elastic_cache
(tests/test_policy_elastic_cache_dream.py): whole runs at temperature 0 against the official windowed loop
(`dream_window_replay.replay_window`) whose calls run each policy's rule in NumPy on the float64 tiny Dream of
tests/numpy_transformer.py (q/k/v biases, grouped keys, AR-shifted logits) — tokens, decode order, NFE, the
positions each call computed and the keys it kept — and the refusals of the policies whose rule the window loop
breaks.

  * dkv_cache, Dream's official rule (`dkv_cache_dream`, shift "un"): a call whose index is a multiple of
    cache_reloading_step is full; call 1 computes the positions not in the set made from the first canvas, a later
    call those p with a mask at p + 1 in the previous call's input (the index wraps), every other position's keys
    and values read from the cache. The window loop has no blocks: the call index is the run's.
  * sparse_dllm, one block (the generation, as under exact Dream decoding): calls 0 and 1 full; at call 1 each
    layer keeps the int(lp × keep_ratio) prompt keys with the largest max-pooled (kernel 3) head mean of the
    generation's mean post-RoPE query against each key; later calls compute the generation and the position before
    it over those keys and their own.
  * dllm_cache: the official hooks as replayed in tests/test_policy_dllm_cache_runs.py (the n-th call's prompt and
    response refreshes by their intervals, layer 0 always, else each layer's lowest-value-similarity response
    positions), here with Dream's q/k/v biases and grouped keys; every position runs through every layer.

d2cache (its official loop decodes a per-step quota) and sparsed (its step E counts the sampler's steps; the window
loop's `steps` is unused) are refused in one line before compiling.
"""

import dataclasses

import jax
import numpy as np
import pytest

from dlm_jax.config import preset
from dlm_jax.model import init_params
from dlm_jax.policy.base import PolicyError
from dlm_jax.policy.registry import parse_policy
from dlm_jax.sampling import dream, driver
from dlm_jax.sampling.run_setup import RunSetup

try:
  from tests import numpy_transformer as ref
  from tests.dream_window_replay import peaked_params, replay_window
  from tests.test_policy_dllm_cache_runs import _hook_layer as dllm_cache_layer
except ImportError:  # run from inside tests/
  import numpy_transformer as ref
  from dream_window_replay import peaked_params, replay_window
  from test_policy_dllm_cache_runs import _hook_layer as dllm_cache_layer

jax.config.update("jax_default_matmul_precision", "highest")

CONFIG = dataclasses.replace(preset("tiny-dream"), n_layers=2)
LP, RELOAD, KEEP_RATIO = 6, 3, 0.5
DLLM = dict(prompt_interval_steps=3, gen_interval_steps=2, transfer_ratio=0.25, refresh_layer0=True)
BUCKETS = (7, 13)
"""dKV-Cache's query buckets: its budget [LP − 1, S) of 13 rows and half of it (two buckets rather than the default
four: a quarter fewer kernels to compile, and the run takes both)."""
POLICIES = {"dkv_cache": f"dkv_cache:cache_reloading_step={RELOAD},query_buckets={len(BUCKETS)}",
            "sparse_dllm": f"sparse_dllm:keep_ratio={KEEP_RATIO},tie_break=lowest_position",
            "dllm_cache": "dllm_cache:" + ",".join(f"{k}={v}" for k, v in DLLM.items())}
EOS = {"dkv_cache": 122, "sparse_dllm": 156, "dllm_cache": 52}
"""Per policy an id row 0 decodes while masks remain after it (row 1 never does): the EOS cut matters."""


@pytest.fixture(scope="module")
def setup():
  """The peaked tiny Dream weights (q/k/v biases, the LM head scaled by 8) and two prompts [2, LP]
  (`jax.random.randint(jax.random.key(2), (2, LP), 3, 200)` written out: no random-number program to compile)."""
  return peaked_params(CONFIG, init_params), np.array([[124, 188, 163, 106, 95, 117], [23, 162, 39, 3, 189, 125]],
                                                      np.int32)


def _options(name):
  return dream.elastic_cache_options(gen_length=12, window=4, eos_token_id=EOS[name])


def _run(setup, name):
  """The run's trace with NumPy fields (indexing a device array compiles a program per slice)."""
  params, prompt = setup
  return jax.device_get(dream.diffusion_generate(params, prompt, config=CONFIG, options=_options(name),
                                                 setup=RunSetup(policy=parse_policy(POLICIES[name]))))


class CachedDream:
  """The NumPy tiny Dream of one row with a per-layer KV cache (post-RoPE keys, values): a full call rewrites it, a
  subset call computes the given positions only, writes their keys and values and reads every other position's
  from it (each layer reading the kept keys only, with `kept`)."""

  def __init__(self, params, config):
    self.params, self.config, self.cache, self.previous = params, config, None, None
    self.computed, self.kept = [], []

  def full(self, tokens):
    """-> (logits [S, V], per layer the post-RoPE queries [S, N, H] and keys [S, K, H])."""
    logits, sites = ref.forward_sites(self.params, tokens[None], self.config)
    positions = np.arange(len(tokens), dtype=np.float64)
    rope = lambda name, layer: ref._rope(sites[f"blocks.{layer}.attn.hook_{name}"], positions,  # noqa: E731
                                         self.config.rope_theta)[0]
    layers = range(self.config.n_layers)
    self.cache = [(rope("k", l)[None], sites[f"blocks.{l}.attn.hook_v"]) for l in layers]
    self.computed.append(np.ones(len(tokens), bool))
    return logits[0], [rope("q", l) for l in layers], [rope("k", l) for l in layers]

  def subset(self, tokens, queries, kept=None):
    """-> logits [S, V], zero where not computed."""
    keys = None if kept is None else [k[None] for k in kept]
    rows, self.cache = ref.subset_forward(self.params, tokens[None], self.config, self.cache, queries[None], keys=keys,
                                          return_cache=True)
    logits = np.zeros((len(tokens), rows.shape[-1]))
    logits[queries] = rows[0]
    self.computed.append(np.isin(np.arange(len(tokens)), queries))
    return logits


def _dkv_call(model, tokens, window_pos):
  """dKV-Cache's Dream rule (module docstring) for the row's call len(model.computed)."""
  call = len(model.computed)
  if call % RELOAD == 0:
    logits = model.full(tokens)[0]
  else:
    held = model.previous != CONFIG.mask_token_id  # d[p]: p held a token in the previous call's input
    cached = np.concatenate([held[1:], held[-1:] if call == 1 else held[:1]])
    logits = model.subset(tokens, np.flatnonzero(~cached))
  model.previous = tokens.copy()
  return logits[window_pos - 1]


def _keep(q, k, margins):
  """One layer's kept prompt keys at call 1: q [S, N, H], k [S, K, H] post-RoPE (module docstring)."""
  q_mean = q[LP:].mean(axis=0)  # [N, H]: the block (the generation) mean
  scores = np.einsum("nh,snh->sn", q_mean, np.repeat(k, q.shape[1] // k.shape[1], axis=1)).mean(axis=1)[:LP]
  padded = np.concatenate([[-np.inf], scores, [-np.inf]])
  pooled = np.max([padded[j:j + LP] for j in range(3)], axis=0)
  order = np.argsort(-pooled, kind="stable")  # ties (a pooled maximum repeated): the lowest position
  count = int(LP * KEEP_RATIO)
  if pooled[order[count - 1]] != pooled[order[count]]:
    margins.append(pooled[order[count - 1]] - pooled[order[count]])
  return np.sort(order[:count])


def _sparse_call(model, tokens, window_pos, margins):
  """Sparse-dLLM with one block (module docstring) for the row's call len(model.computed)."""
  call = len(model.computed)
  if call <= 1:
    logits, q, k = model.full(tokens)
    if call == 1:
      model.kept = [_keep(q[l], k[l], margins) for l in range(CONFIG.n_layers)]
  else:
    logits = model.subset(tokens, np.arange(LP - 1, len(tokens)), [kept[kept != LP - 1] for kept in model.kept])
  return logits[window_pos - 1]


def _dllm_cache_call(model, tokens, window_pos):
  """dLLM-Cache's official hooks (tests/test_policy_dllm_cache_runs.py, with Dream's biases and grouped keys) for
  the row's call len(model.computed) + 1 (1-based): model.computed gets the positions each layer recomputed [L, S]."""
  p, s = {k: np.asarray(v, np.float64) for k, v in ref._flat(model.params).items()}, len(tokens)
  if model.cache is None:
    kv, d = CONFIG.n_kv_heads * CONFIG.head_dim, CONFIG.d_model
    model.cache = [{"k": np.zeros((1, s, kv)), "v": np.zeros((1, s, kv)), "attn": np.zeros((1, s, d)),
                    "mlp": np.zeros((1, s, d))} for _ in range(CONFIG.n_layers)]
  h, layers = p["embed.embedding"][tokens][None], []
  for layer in range(CONFIG.n_layers):
    h, rows = dllm_cache_layer(p, layer, h, model.cache[layer], len(model.computed) + 1, DLLM, LP, CONFIG)
    layers.append(rows[0])
  model.computed.append(np.stack(layers))
  return ref.readout(model.params, h, CONFIG)[0, window_pos - 1]


def _replay(setup, name, row, margins):
  params, prompt = setup
  model = CachedDream(params, CONFIG)
  if name == "dllm_cache":
    call = lambda tokens, window_pos, masked, decoded: _dllm_cache_call(model, tokens, window_pos)  # noqa: E731
  elif name == "dkv_cache":
    call = lambda tokens, window_pos, masked, decoded: _dkv_call(model, tokens, window_pos)  # noqa: E731
  else:
    call = lambda tokens, window_pos, masked, decoded: _sparse_call(model, tokens, window_pos, margins)  # noqa: E731
  tokens, decode_step, calls, cut = replay_window(call, prompt[row], _options(name), CONFIG.mask_token_id, EOS[name],
                                                  margins)
  return tokens, decode_step, calls, cut, np.asarray(model.computed), model.kept


@pytest.mark.parametrize("name", ["dkv_cache", "sparse_dllm", "dllm_cache"])
def test_a_policy_on_the_official_dream_decoding_is_the_replay_of_its_rule(setup, name):
  """Each row's tokens (masks left after the EOS cut), decode order, NFE, computed positions per call and (Sparse-dLLM)
  kept keys are the replay's, in a batch whose rows finish at different calls."""
  trace = _run(setup, name)
  margins, nfes, cuts, parallel, counts = [], [], [], 0, []
  for row in range(2):
    tokens, decode_step, calls, cut, computed, kept = _replay(setup, name, row, margins)
    np.testing.assert_array_equal(np.asarray(trace.tokens[row]), tokens, err_msg=f"{name} row {row}")
    np.testing.assert_array_equal(np.asarray(trace.decode_step[row]), decode_step, err_msg=f"{name} row {row}")
    assert int(trace.row_nfe[row]) == calls
    np.testing.assert_array_equal(np.asarray(trace.active_rows[:calls, row]), True)
    if name == "dllm_cache":  # every position runs through every layer; the record has what each layer recomputed
      assert np.asarray(trace.computed_positions[:calls, row]).all()
      np.testing.assert_array_equal(np.asarray(trace.policy_record[:calls, row]), computed)
    else:
      np.testing.assert_array_equal(np.asarray(trace.computed_positions[:calls, row]), computed, err_msg=name)
    assert not computed.all()
    if name == "sparse_dllm":
      record = np.asarray(trace.policy_record[2:calls, row])  # [calls − 2, L, n_keep]
      np.testing.assert_array_equal(record, np.broadcast_to(np.stack(kept), record.shape))
    nfes.append(calls)
    cuts.append(cut)
    counts.append(np.where(computed.all(-1), -1, computed.sum(-1)))  # -1: a full call
    parallel += int(np.max(np.bincount(decode_step[decode_step >= 0])) > 1)
  assert min(margins) > 1e-5, min(margins)  # no decision within float32's reach of flipping
  assert cuts == [True, False] and nfes[0] != nfes[1] and parallel, (cuts, nfes, parallel)
  assert int(trace.nfe) == max(nfes)
  if name == "dkv_cache":  # while both rows run, a cached call runs at the smallest bucket holding the batch's count
    both = min(nfes)
    count = np.max([c[:both] for c in counts], axis=0)
    s = LP + 12
    rows = [s if c < 0 else min(b for b in BUCKETS if b >= c) for c in count]
    np.testing.assert_array_equal(np.asarray(trace.policy_record["rows"][:both]), np.stack([rows, rows], axis=1))
    assert len(set(rows) - {s}) > 1, rows


@pytest.mark.parametrize("name, message", [
    ("d2cache", "policy d2cache does not run with a decoding window or EOS truncation"),
    ("sparsed", "policy sparsed runs with the llada, dream samplers and their threshold and factor modes .* not "
                "dream_window"),
])
def test_policies_whose_rule_the_window_loop_breaks_are_refused_before_compiling(setup, name, message):
  """d2cache's official loop decodes a per-step quota (the window loop has none); SparseD's step E counts the
  sampler's steps (the window loop runs as many calls as it needs, `steps` unused)."""
  params, prompt = setup
  traced = dict(driver.TRACE_COUNTS)
  with pytest.raises(PolicyError, match=message) as refused:
    dream.diffusion_generate(params, prompt, config=CONFIG, options=_options("dkv_cache"),
                             setup=RunSetup(policy=parse_policy(name)))
  assert "\n" not in str(refused.value)
  assert dict(driver.TRACE_COUNTS) == traced
