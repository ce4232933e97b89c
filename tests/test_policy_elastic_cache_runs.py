"""Elastic-Cache runs as a compute policy (issue 36): the layer refresh inside the forward against a whole-run
NumPy replay of the official loop (`generate_with_elastic_cache` and `LLaDABlock.attention` of VILA-Lab/
Elastic-Cache, read through its mirror yxu-dev/Elastic-Cache): per-layer input, query, key and value caches,
the tracked tokens, the drift test and the refresh from the layer after the first drifted one — decoded by the
exact semi-autoregressive LLaDA rule (one token per step, the most confident masked position of the current
block), the configuration these tests replay: window_length = block_length, block_caching, track_num 1.

The replay keeps the official query cache (the module under test recomputes those rows from the cached layer
inputs instead) and runs in float64 on the same random weights.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlm_jax.config import preset
from dlm_jax.instrument import interventions
from dlm_jax.instrument.stats import StatsSpec
from dlm_jax.model import Compute, KVCache, forward, init_params
from dlm_jax.model.compute_subset import ComputeSubset
from dlm_jax.model.layer_refresh import LayerRefresh
from dlm_jax.policy import cost
from dlm_jax.policy.elastic_cache_policy import ElasticCache
from dlm_jax.policy.registry import parse_policy
from dlm_jax.sampling import llada, sliding_window
from dlm_jax.sampling.run_setup import RunSetup

jax.config.update("jax_default_matmul_precision", "highest")

CONFIG = dataclasses.replace(preset("tiny-llada"), n_layers=3)
OPTIONS = llada.LLaDAOptions(gen_length=8, steps=8, block_length=4)
PROMPT_LENGTH = 6  # the threshold runs' prompts
LONG_PROMPT = 12  # the exact sampler's prompts: longer than the budget's tracked slots plus one window (3 + 4)
GAMMA = 0.97
EOS = 196  # an id the peaked model decodes in one row's run, where cutting the policy's masked set matters
THRESHOLD_OPTIONS = llada.elastic_cache_options(gen_length=16, window=4, eos_token_id=EOS)


@pytest.fixture(scope="module")
def setup():
  params = init_params(CONFIG, jax.random.key(0))
  prompt = jax.random.randint(jax.random.key(1), (2, LONG_PROMPT), 3, 200)
  return params, prompt


@pytest.fixture(scope="module")
def threshold_setup():
  """Random weights with the LM head scaled by 8 (some proposals are confident, so calls decode several
  positions) and prompts whose runs decode EOS in one row only."""
  params = init_params(CONFIG, jax.random.key(0))
  params["lm_head"]["kernel"] = params["lm_head"]["kernel"] * 8.0
  return params, jax.random.randint(jax.random.key(4), (2, PROMPT_LENGTH), 3, 200)


@pytest.fixture(scope="module")
def batch_run(setup):
  params, prompt = setup
  return llada.generate(params, prompt, config=CONFIG, options=OPTIONS,
                        setup=RunSetup(policy=parse_policy(f"elastic_cache:window_length=4,gamma={GAMMA}")))


@pytest.fixture(scope="module")
def exact_run(setup):
  """The exact sampler (no policy) on the same prompts."""
  params, prompt = setup
  return llada.generate(params, prompt, config=CONFIG, options=OPTIONS)


def _numpy_params(params):
  return jax.tree.map(lambda a: np.asarray(a, np.float64), params)


def _rms(x, w, eps):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x, positions, theta):
  """x [T, N, H] rotated at positions [T] (rotate-half)."""
  h = x.shape[-1]
  inv_freq = 1.0 / theta ** (np.arange(0, h, 2) / h)
  angles = positions[:, None] * inv_freq[None, :]
  angles = np.concatenate([angles, angles], axis=-1)[:, None, :]
  rotated = np.concatenate([-x[..., h // 2:], x[..., :h // 2]], axis=-1)
  return x * np.cos(angles) + rotated * np.sin(angles)


def _softmax(x):
  e = np.exp(x - x.max(axis=-1, keepdims=True))
  return e / e.sum(axis=-1, keepdims=True)


def _official_call(p, x_tokens, caches, call, track, decoded, window_pos, pending, gamma, margins, track_num=1):
  """One call of the official loop (`generate_with_elastic_cache` → `LLaDABlock.attention`) for one row: call 0
  runs every position, a later call the queries track ∪ decoded ∪ window_pos through the layers below its
  refresh start, every position from it on; pending: the still-masked set zeroed in the tracked-token score.
  Updates the caches; appends |drift similarity − gamma| to margins. -> (the window's logits [W, V], the
  tracked tokens (unique), the first refreshed layer (0 for call 0, L for none))."""
  c = CONFIG
  n_layers, n, hd = c.n_layers, c.n_heads, c.head_dim
  blocks = p["blocks"]
  s = len(x_tokens)
  if call == 0:
    query, start = np.arange(s), -1
  else:
    query, start = np.concatenate([track, decoded, window_pos]), n_layers
  x = p["embed"]["embedding"][x_tokens[query]]
  tracked_per_layer = []
  for layer in range(n_layers):
    w = {name: blocks["attn"][name]["kernel"][layer] for name in ("q", "k", "v", "o")}
    if layer > start:
      caches["x"][layer] = x.copy()
    else:
      caches["x"][layer][query] = x
      if layer == start:
        x = caches["x"][layer].copy()
    full = layer >= start
    rows = np.arange(s) if full else query
    h = _rms(x, blocks["attn_norm"]["weight"][layer], c.norm_eps)
    q = _rope((h @ w["q"]).reshape(-1, n, hd), rows, c.rope_theta)
    k = _rope((h @ w["k"]).reshape(-1, n, hd), rows, c.rope_theta)
    v = (h @ w["v"]).reshape(-1, n, hd)
    if full:
      caches["q"][layer], caches["k"][layer], caches["v"][layer] = q, k, v
    else:
      past_k = caches["k"][layer].copy()
      past_q = caches["q"][layer][track].copy()
      caches["k"][layer][query], caches["v"][layer][query], caches["q"][layer][query] = k, v, q
    keys, values = caches["k"][layer], caches["v"][layer]
    probs = _softmax(np.einsum("tnh,snh->nts", q, keys) / np.sqrt(hd))  # [N, T, S]
    out = np.einsum("nts,snh->tnh", probs, values).reshape(-1, n * hd) @ w["o"]
    if full:
      masked_rows = probs[:, window_pos]
    else:
      masked_rows = probs[:, len(query) - len(window_pos):]
      before = _softmax(np.einsum("tnh,snh->nts", past_q, past_k) / np.sqrt(hd))
      now = probs[:, :len(track)]
      cosine = np.sum(before * now, 0) / np.maximum(np.linalg.norm(before, axis=0) * np.linalg.norm(now, axis=0),
                                                    1e-8)
      margins.append(abs(cosine.mean() - gamma))
      if cosine.mean() < gamma:
        start = layer + 1
    score = masked_rows.sum(axis=(0, 1))
    score[pending] = 0.0
    tracked_per_layer.append(np.argsort(-score, kind="stable")[:track_num])
    x = x + out
    mlp_in = _rms(x, blocks["mlp_norm"]["weight"][layer], c.norm_eps)
    gate, up = mlp_in @ blocks["mlp"]["gate"]["kernel"][layer], mlp_in @ blocks["mlp"]["up"]["kernel"][layer]
    x = x + (gate / (1 + np.exp(-gate)) * up) @ blocks["mlp"]["down"]["kernel"][layer]
  logits = _rms(x, p["final_norm"]["weight"], c.norm_eps) @ p["lm_head"]["kernel"]
  logits = logits[window_pos] if len(x) == s else logits[len(query) - len(window_pos):]
  return logits, np.unique(np.concatenate(tracked_per_layer)), 0 if call == 0 else start


def _new_caches():
  return {name: [None] * CONFIG.n_layers for name in ("x", "q", "k", "v")}


def _replay(p, prompt, gamma, window, track_num=1):
  """The official loop for one row (module docstring): (tokens [S], decode step per generated position [G],
  NFE, first refreshed layer per call (0 for call 0, L for none), the smallest distance of a tested drift
  similarity from gamma)."""
  c = CONFIG
  lp, gen = len(prompt), OPTIONS.gen_length
  x_tokens = np.concatenate([prompt, np.full(gen, c.mask_token_id)])
  caches = _new_caches()
  track, decoded = np.zeros(0, int), np.zeros(0, int)
  steps_per_block = OPTIONS.steps // (gen // OPTIONS.block_length)
  decode_step, starts, margins = np.full(gen, -1), [], []
  for call in range(OPTIONS.steps):
    pending = np.flatnonzero(x_tokens == c.mask_token_id)
    pending = pending[pending >= lp]
    window_pos = pending[:window]
    logits, track, start = _official_call(p, x_tokens, caches, call, track, decoded, window_pos, pending, gamma,
                                          margins, track_num)
    starts.append(start)
    block_end = lp + (call // steps_per_block + 1) * OPTIONS.block_length
    probs = _softmax(logits)
    confidence = np.where(window_pos < block_end, probs.max(-1), -np.inf)
    best = int(np.argmax(confidence))
    decoded = window_pos[best:best + 1]
    x_tokens[decoded] = int(np.argmax(logits[best]))
    decode_step[decoded - lp] = call
  return x_tokens, decode_step, OPTIONS.steps, np.asarray(starts), min(margins)


def _replay_threshold(p, prompt, gamma, window, eos_id, threshold, margins):
  """The official loop with its own decoding (`generate_with_elastic_cache`, threshold set) for one row: the
  window is the first `window` still-masked positions; every window position whose top probability is >=
  min(threshold, the window's largest) takes its argmax; after the first call that decodes eos_id, the
  still-masked set keeps only the positions before the smallest EOS that call decoded; the loop ends when the
  set is empty. Appends |confidence − threshold| and the gap of the two most confident to margins.
  -> (tokens [S], decode step per generated position [G] (-1: never), NFE, first refreshed layer per call)."""
  c = CONFIG
  lp, gen = len(prompt), THRESHOLD_OPTIONS.gen_length
  x_tokens = np.concatenate([prompt, np.full(gen, c.mask_token_id)])
  caches = _new_caches()
  masked = np.arange(lp, lp + gen)
  track, decoded = np.zeros(0, int), np.zeros(0, int)
  decode_step, starts, decoded_eos, call = np.full(gen, -1), [], False, 0
  while True:
    window_pos = masked[:window]
    logits, track, start = _official_call(p, x_tokens, caches, call, track, decoded, window_pos, masked, gamma,
                                          margins)
    starts.append(start)
    probs = _softmax(logits)
    confidence, x0 = probs.max(-1), probs.argmax(-1)
    keep = confidence >= min(threshold, confidence.max())
    margins.extend(np.abs(confidence - threshold))
    if len(confidence) > 1:
      margins.append(np.diff(np.sort(confidence)[-2:])[0])
    assert not np.any(x0[keep] == c.mask_token_id), "the mask id decoded: the sampler would keep it a candidate"
    decoded = window_pos[keep]
    x_tokens[decoded] = x0[keep]
    decode_step[decoded - lp] = call
    masked = masked[~np.isin(masked, decoded)]
    call += 1
    eos = decoded[x0[keep] == eos_id]
    if not decoded_eos and len(eos):
      decoded_eos = True
      masked = masked[masked <= eos.min()]
    if len(masked) == 0:
      return x_tokens, decode_step, call, np.asarray(starts)


def _replay_blocks(p, prompt, gamma, window, threshold, block, margins):
  """The official per-call computation under Fast-dLLM's threshold decoding in blocks (not the official
  decoding: what `elastic_cache` does with `LLaDAOptions(threshold=..., block_length=block)`): the window is the
  first `window` still-masked positions from the current block's start on, the candidates the block's masks
  (at least the most confident, then every one >= threshold), a block ends when it holds no mask (at most
  `block` calls). Appends |confidence − threshold| and the gap of the two most confident to margins.
  -> (tokens [S], decode step per generated position [G], NFE, first refreshed layer per call, the calls whose
  window reached into the next block)."""
  c = CONFIG
  lp, gen = len(prompt), THRESHOLD_OPTIONS.gen_length
  x_tokens = np.concatenate([prompt, np.full(gen, c.mask_token_id)])
  caches = _new_caches()
  track, decoded = np.zeros(0, int), np.zeros(0, int)
  decode_step, starts, call, crossed = np.full(gen, -1), [], 0, 0
  for block_start in range(lp, lp + gen, block):
    for _ in range(block):
      pending = np.flatnonzero(x_tokens == c.mask_token_id)
      pending = pending[pending >= lp]
      if not np.any(pending < block_start + block):
        break
      window_pos = pending[pending >= block_start][:window]
      logits, track, start = _official_call(p, x_tokens, caches, call, track, decoded, window_pos, pending, gamma,
                                            margins)
      starts.append(start)
      probs = _softmax(logits)
      candidate = window_pos < block_start + block
      crossed += int(not candidate.all())
      confidence, x0 = np.where(candidate, probs.max(-1), -np.inf), probs.argmax(-1)
      keep = candidate & ((confidence >= threshold) | (np.arange(len(window_pos)) == np.argmax(confidence)))
      margins.extend(np.abs(confidence[candidate] - threshold))
      if candidate.sum() > 1:
        margins.append(np.diff(np.sort(confidence[candidate])[-2:])[0])
      assert not np.any(x0[keep] == c.mask_token_id), "the mask id decoded"
      decoded = window_pos[keep]
      x_tokens[decoded] = x0[keep]
      decode_step[decoded - lp] = call
      call += 1
  return x_tokens, decode_step, call, np.asarray(starts), crossed


def test_a_whole_run_replays_the_official_loop(setup, batch_run):
  params, prompt = setup
  p = _numpy_params(params)
  starts = []
  for row in range(prompt.shape[0]):
    tokens, decode_step, nfe, start, margin = _replay(p, np.asarray(prompt[row]), GAMMA, window=4)
    assert margin > 1e-5, margin  # no drift decision close enough to gamma for float32 to take it otherwise
    np.testing.assert_array_equal(np.asarray(batch_run.tokens[row]), tokens)
    np.testing.assert_array_equal(np.asarray(batch_run.decode_step[row]), decode_step)
    assert int(batch_run.nfe) == nfe
    np.testing.assert_array_equal(np.asarray(batch_run.policy_record["refresh_start"][:, row]), start)
    starts.append(start)
  starts = np.concatenate(starts)
  assert set(starts[starts > 0]) > {CONFIG.n_layers}, starts  # the run refreshes from a layer and skips, both


def test_the_official_threshold_decoding_replays_the_official_loop(threshold_setup):
  """`llada.elastic_cache_options` (threshold 0.9 over a sliding window, EOS truncation, one block) with the
  policy of the same window: the tokens (masks left after the EOS cut), decode order, NFE and refresh starts of
  the official loop, each row in a batch whose rows finish at different calls."""
  params, prompt = threshold_setup
  trace = llada.generate(params, prompt, config=CONFIG, options=THRESHOLD_OPTIONS,
                         setup=RunSetup(policy=parse_policy(f"elastic_cache:window_length=4,gamma={GAMMA}")))
  p = _numpy_params(params)
  margins, nfes, cut_rows, parallel_calls = [], [], 0, 0
  for row in range(prompt.shape[0]):
    tokens, decode_step, nfe, starts = _replay_threshold(p, np.asarray(prompt[row]), GAMMA, 4, EOS, 0.9, margins)
    np.testing.assert_array_equal(np.asarray(trace.tokens[row]), tokens, err_msg=f"row {row}")
    np.testing.assert_array_equal(np.asarray(trace.decode_step[row]), decode_step, err_msg=f"row {row}")
    assert int(trace.row_nfe[row]) == nfe
    np.testing.assert_array_equal(np.asarray(trace.policy_record["refresh_start"][:nfe, row]), starts)
    nfes.append(nfe)
    cut_rows += int(np.any(decode_step < 0))
    parallel_calls += int(np.max(np.bincount(decode_step[decode_step >= 0])) > 1)
    assert set(starts[1:]) > {CONFIG.n_layers}, starts
  assert min(margins) > 1e-5, min(margins)  # no threshold or drift decision within float32's reach of flipping
  assert cut_rows == 1 and parallel_calls >= 1 and nfes[0] != nfes[1], (cut_rows, parallel_calls, nfes)
  assert int(trace.nfe) == max(nfes)


def test_threshold_decoding_in_blocks_is_the_replay(threshold_setup):
  """Fast-dLLM threshold decoding in blocks of 4 (a block takes as many calls as it needs; rows wait for each
  other at block ends) under the policy: the window is the first 4 masks from the sampler's block on (reaching
  into the next block when fewer are left), and the run is the replay's."""
  params, prompt = threshold_setup
  options = llada.LLaDAOptions(gen_length=16, steps=16, block_length=4, threshold=0.9)
  trace = llada.generate(params, prompt, config=CONFIG, options=options,
                         setup=RunSetup(policy=parse_policy(f"elastic_cache:window_length=4,gamma={GAMMA}")))
  p = _numpy_params(params)
  margins, calls_per_block, crossed = [], set(), 0
  for row in range(prompt.shape[0]):
    tokens, decode_step, nfe, starts, row_crossed = _replay_blocks(p, np.asarray(prompt[row]), GAMMA, 4, 0.9, 4,
                                                                   margins)
    active = np.asarray(trace.active_rows[:int(trace.nfe), row])  # the row waits while the other ends a block
    own_call = np.cumsum(active) - 1
    np.testing.assert_array_equal(np.asarray(trace.tokens[row]), tokens, err_msg=f"row {row}")
    np.testing.assert_array_equal(own_call[np.asarray(trace.decode_step[row])], decode_step, err_msg=f"row {row}")
    assert int(trace.row_nfe[row]) == nfe
    np.testing.assert_array_equal(np.asarray(trace.policy_record["refresh_start"][:int(trace.nfe), row])[active],
                                  starts)
    calls_per_block |= {len(set(decode_step[k:k + 4])) for k in range(0, 16, 4)}
    crossed += row_crossed
  assert min(margins) > 1e-5, min(margins)
  assert len(calls_per_block) > 1 and crossed, (calls_per_block, crossed)  # blocks of different lengths


def test_the_eos_cut_is_the_first_eos_of_the_first_call_that_decoded_one():
  """`sliding_window.eos_cut`: row 0 decodes EOS at position 3 (call 2), then at 1 and 4 (call 3): the cut stays
  at 3 (the official loop cuts once); row 1 decodes none (G)."""
  generated = jnp.asarray([[5, EOS, 7, EOS, EOS], [5, 6, 7, 8, 9]])
  decode_step = jnp.asarray([[0, 3, 1, 2, 3], [0, 1, 2, 3, 4]])
  np.testing.assert_array_equal(np.asarray(sliding_window.eos_cut(generated, decode_step, EOS)), [3, 5])


def test_a_row_in_a_batch_is_bitwise_the_row_alone_with_statistics_and_sink_masking(setup, batch_run):
  """Batch-invariant mode: every row decides alone (its own tracked tokens, drift and refresh start); the
  statistics and the sink-masking bias keep working through subset and full layers."""
  params, prompt = setup
  run = dict(config=CONFIG, options=OPTIONS, policy=parse_policy(f"elastic_cache:window_length=4,gamma={GAMMA}"),
             batch_invariant=True, intervention=interventions.MaskPreviousSinks(top_k=1),
             stats_spec=StatsSpec(incoming_attention=True))
  batch = llada.generate(params, prompt, **run)
  alone = llada.generate(params, prompt[1:], **run)
  np.testing.assert_array_equal(np.asarray(alone.tokens[0]), np.asarray(batch.tokens[1]))
  np.testing.assert_array_equal(np.asarray(alone.stats["incoming_attention"][:, :, 0]),
                                np.asarray(batch.stats["incoming_attention"][:, :, 1]))
  np.testing.assert_array_equal(np.asarray(alone.policy_record["refresh_start"][:, 0]),
                                np.asarray(batch.policy_record["refresh_start"][:, 1]))
  queries = np.asarray(batch_run.policy_record["queries"][:, 1])
  computed = np.asarray(batch_run.computed_positions[:, 1])
  assert computed[0].all()
  for step in range(1, OPTIONS.steps):
    np.testing.assert_array_equal(np.flatnonzero(computed[step]), queries[step][queries[step] < computed.shape[-1]])


def test_a_refresh_from_layer_0_is_the_exact_sampler(setup, exact_run):
  params, prompt = setup

  @dataclasses.dataclass(frozen=True)
  class Always(ElasticCache):
    def decide(self, state, context):
      return dataclasses.replace(super().decide(state, context), full=jnp.ones((), bool))

  exact = exact_run
  refreshed = llada.generate(params, prompt, config=CONFIG, options=OPTIONS,
                             setup=RunSetup(policy=Always(window_length=4)))
  np.testing.assert_array_equal(np.asarray(refreshed.tokens), np.asarray(exact.tokens))
  np.testing.assert_array_equal(np.asarray(refreshed.decode_step), np.asarray(exact.decode_step))
  assert np.all(np.asarray(refreshed.policy_record["refresh_start"]) == 0)


def test_a_call_without_refresh_leaves_the_flop_count():
  """XLA's cost analysis counts a loop body once and a conditional at its costliest branch, so each branch is
  measured as the benchmark measures calls: a one-layer program whose refresh start is a compile-time
  constant (XLA then drops the conditional); the rest are arguments."""
  one = dataclasses.replace(CONFIG, n_layers=1)
  params = jax.eval_shape(lambda: init_params(one, jax.random.key(0)))  # shapes only: nothing runs
  s, t, r = 64, 12, 3
  args = (params, jnp.zeros((1, s), jnp.int32), KVCache.zeros(one, 1, s), jnp.zeros((1, 1, s, one.d_model)))
  queries, tracked = jnp.arange(t, dtype=jnp.int32)[None], jnp.arange(r, dtype=jnp.int32)[None]
  positions = jnp.arange(s, dtype=jnp.int32)[None]

  def flops(fn):
    return jax.jit(fn).lower(*args).compile().cost_analysis()["flops"]

  def refresh_call(start):
    def call(p, x, c, hidden):
      refresh = LayerRefresh(hidden=hidden, tracked=tracked, start=jnp.full((1,), start), gamma=0.9, tokens=x,
                             positions=positions)
      return forward(p, x[:, :t], config=one,
                     compute=Compute(cache=c, subset=ComputeSubset(queries, None, refresh))).logits
    return flops(call)

  full = flops(lambda p, x, c, hidden: forward(p, x, config=one, compute=Compute(cache=c)).logits)
  measured = {start: refresh_call(start) for start in (0, 1)}
  analytic = {start: cost.layer_refresh_flops(one, t, s, r, start) + cost.head_flops(one, t) for start in (0, 1)}
  for start in (0, 1):
    assert abs(measured[start] - analytic[start]) < 0.1 * analytic[start], (start, measured, analytic)
  assert measured[1] < 0.3 * full, (measured, full)  # 12 of 64 queries, plus the drift test


@pytest.mark.parametrize("text, message", [
    ("elastic_cache:gamma=0", "elastic_cache gamma must be a number in"),
    ("elastic_cache:window_length=0", "elastic_cache window_length must be an int >= 1"),
    ("elastic_cache:track_num=0", "elastic_cache track_num must be an int >= 1"),
    ("elastic_cache:threshold=0.9", "policy elastic_cache has no knob 'threshold'"),
])
def test_bad_knobs_are_refused_in_one_line(text, message):
  with pytest.raises(ValueError, match=message):
    parse_policy(text)


@pytest.mark.parametrize("options, message", [
    (dict(window=4), "window and eos_truncation .Elastic-Cache's decoding. run with threshold or factor decoding"),
    (dict(threshold=0.9, eos_truncation=True, cache="prefix"), "run with threshold or factor decoding, cache='none'"),
    (dict(threshold=0.9, window=0), "window must be a positive integer or None, got 0"),
])
def test_bad_decoding_options_are_refused_in_one_line(options, message):
  with pytest.raises(ValueError, match=message):
    llada.LLaDAOptions(gen_length=8, steps=8, block_length=8, **options)


@pytest.mark.parametrize("run, message", [
    (lambda p, x: llada.generate(p, x, config=CONFIG, options=OPTIONS,
                                 policy=parse_policy("elastic_cache:window_length=3")),
     "window_length=3 is shorter than the sampler's block_length=4"),
    (lambda p, x: llada.generate(p, x, config=CONFIG, options=llada.elastic_cache_options(gen_length=16, window=8),
                                 policy=parse_policy("elastic_cache:window_length=4")),
     "window_length=4 is shorter than the sampler's decoding window=8"),
    (lambda p, x: llada.generate(p, x, config=CONFIG, options=dataclasses.replace(OPTIONS, threshold=0.9, cache="dual"),
                                 policy=parse_policy("elastic_cache:window_length=4")),
     "does not compose with cache='dual'"),
])
def test_runs_it_cannot_take_are_refused_before_compiling(setup, run, message):
  params, prompt = setup
  with pytest.raises(ValueError, match=message):
    run(params, prompt)


def test_the_first_call_reads_the_window_whatever_the_prompt_length(batch_run, exact_run):
  """Call 0 is full; its query set (the rows the sampler reads) is the window alone: only generated positions
  count as "decoded at the previous call". A prompt longer than the budget's tracked slots plus one window
  (12 > 3 + 4 here: the replay test's prompts) once counted as decoded and pushed the window out of the budget, so
  the sampler read zero logits (the sweep's accuracy was 0)."""
  for row in range(2):
    first = np.asarray(exact_run.decode_step[row]) == 0
    np.testing.assert_array_equal(np.asarray(batch_run.decode_step[row]) == 0, first)
    np.testing.assert_array_equal(np.asarray(batch_run.tokens[row, LONG_PROMPT:])[first],
                                  np.asarray(exact_run.tokens[row, LONG_PROMPT:])[first])
