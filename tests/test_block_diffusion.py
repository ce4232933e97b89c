"""Block diffusion with an exact KV cache (`dlm_jax.sampling.block_diffusion`) against a step-by-step NumPy
re-implementation of the algorithm (`reference/decoding_modes.md` §6) written here, with its own float64
block-causal forward and its own per-layer key/value cache; cached against uncached runs; batches, EOS stop,
interventions and errors.

The tiny model has blocks of 8; prompts of 11 tokens put one complete block in the prefill and the prompt's
last 3 tokens in the first decoded block; G = 10 gives T = 24 (the generation extended to 13 positions)."""

import dataclasses
import functools

import jax
import numpy as np
import pytest

from dlm_jax.instrument import interventions as iv
from dlm_jax import model
from dlm_jax.config import preset
from dlm_jax.sampling import block_diffusion as bd
from dlm_jax.sampling import driver, model_call
from dlm_jax.instrument.stats import StatsSpec

jax.config.update("jax_default_matmul_precision", "highest")

BLOCK, LP, GEN = 8, 11, 10
CONFIG = preset("tiny-llada").replace(attention_block_size=BLOCK)
MASK = CONFIG.mask_token_id
TOTAL = -(-(LP + GEN) // BLOCK) * BLOCK
PER_HEAD = StatsSpec(incoming_attention=True, per_head=True)


@functools.lru_cache(maxsize=None)
def peaked_params():
  """Random weights with a scaled LM head, so that many proposals are confident (well above or below τ)."""
  params = model.init_params(CONFIG, jax.random.key(3))
  params["lm_head"]["kernel"] = params["lm_head"]["kernel"] * 6.0
  return params


def prompts(batch=2, seed=0, length=LP):
  return np.random.default_rng(seed).integers(3, 200, size=(batch, length)).astype(np.int32)


# ---------------------------------------------------------------- NumPy block-causal model with its own cache


@functools.lru_cache(maxsize=None)
def _np_params():
  flat = model.flatten_params(peaked_params())
  return {name: np.asarray(value, np.float64) for name, value in flat.items()}


def _rms(x, w):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + CONFIG.norm_eps) * w


def _rope(x, positions):
  """x [T, N, H] rotated (rotate-half) at positions [T]."""
  h = x.shape[-1]
  inv = 1.0 / CONFIG.rope_theta ** (np.arange(0, h, 2) / h)
  ang = np.concatenate([positions[:, None] * inv[None, :]] * 2, axis=-1)
  rot = np.concatenate([-x[..., h // 2:], x[..., :h // 2]], axis=-1)
  return x * np.cos(ang)[:, None] + rot * np.sin(ang)[:, None]


def np_forward(tokens, start, stop, cache=None, sink_front=False, keys=None, queries_out=None):
  """One row: tokens [S]; computes the queries [start, stop) with block-causal attention (query i sees key j
  iff j // BLOCK <= i // BLOCK). cache: per layer (K, V) [S, K, H] after RoPE, read outside [start, stop);
  None = nothing computed before (the keys outside [start, stop) must then be invisible). sink_front: query
  0 sees only key 0. keys: None, or per layer the cached positions the queries read besides their own [start,
  stop) (a compute policy's key subset). queries_out: None, or a list that collects each layer's post-RoPE
  queries [stop − start, N, H]. Returns (logits [stop − start, V], the cache with this call's keys and values
  written, per-layer probabilities [N, stop − start, S], zero at unread keys)."""
  c, p = CONFIG, _np_params()
  s_len = tokens.shape[0]
  query = np.arange(start, stop)
  group = c.n_heads // c.n_kv_heads
  visible = np.arange(s_len)[None, :] // BLOCK <= query[:, None] // BLOCK
  if sink_front and start == 0:
    visible[0, 1:] = False
  x = p["embed.embedding"][tokens[start:stop]]
  new_cache, probs_all = [], []
  for layer in range(c.n_layers):
    w = lambda name: p[f"blocks.{name}"][layer]  # noqa: B023
    h = _rms(x, w("attn_norm.weight"))
    q = _rope((h @ w("attn.q.kernel")).reshape(-1, c.n_heads, c.head_dim), query.astype(np.float64))
    k = _rope((h @ w("attn.k.kernel")).reshape(-1, c.n_kv_heads, c.head_dim), query.astype(np.float64))
    v = (h @ w("attn.v.kernel")).reshape(-1, c.n_kv_heads, c.head_dim)
    layer_keys = np.zeros((s_len, c.n_kv_heads, c.head_dim)) if cache is None else cache[layer][0].copy()
    values = np.zeros_like(layer_keys) if cache is None else cache[layer][1].copy()
    layer_keys[start:stop], values[start:stop] = k, v
    new_cache.append((layer_keys, values))
    if queries_out is not None:
      queries_out.append(q)
    read = visible
    if keys is not None:
      read = visible & (np.isin(np.arange(s_len), keys[layer]) | ((np.arange(s_len) >= start)
                                                                   & (np.arange(s_len) < stop)))[None, :]
    head_keys, head_values = np.repeat(layer_keys, group, axis=1), np.repeat(values, group, axis=1)
    scores = np.where(read[None], np.einsum("tnh,snh->nts", q, head_keys) / np.sqrt(c.head_dim), -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    probs_all.append(probs)
    x = x + np.einsum("nts,snh->tnh", probs, head_values).reshape(-1, c.n_heads * c.head_dim) @ w("attn.o.kernel")
    h = _rms(x, w("mlp_norm.weight"))
    gate = h @ w("mlp.gate.kernel")
    x = x + ((gate / (1 + np.exp(-gate))) * (h @ w("mlp.up.kernel"))) @ w("mlp.down.kernel")
  return _rms(x, p["final_norm.weight"]) @ p["lm_head.kernel"], new_cache, probs_all


# ---------------------------------------------------------------- the reference algorithm


def _softmax(x):
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def reference_decide(logits, candidates, transfer, threshold, quota, margins):
  """Block positions to commit at one step: LLaDA2.0's rule ("llada2": all p > τ if at least `quota` of
  them, else the top-min(quota, #masks)) or Fast-dLLM's ("fast_dllm": p ≥ τ plus the top one). Appends to
  `margins` how far each decision was from flipping: the argmax's probability gap to the runner-up, |p − τ|
  and, where a count of top candidates is taken, the gap at its boundary."""
  probs = _softmax(logits)
  x0 = probs.argmax(-1)
  top2 = np.sort(probs, axis=-1)[:, -2:]
  conf = probs[np.arange(len(x0)), x0]
  cand = sorted(np.flatnonzero(candidates), key=lambda j: (-conf[j], j))
  margins.extend(top2[cand, 1] - top2[cand, 0])
  if threshold is not None:
    margins.extend(np.abs(conf[cand] - threshold))
  if transfer == "llada2":
    high = [j for j in cand if threshold is not None and conf[j] > threshold]
    chosen = high if len(high) >= quota else cand[:min(quota, len(cand))]
    boundary = len(chosen) if len(high) < quota else None
  else:
    chosen = cand[:1] + [j for j in cand[1:] if conf[j] >= threshold]
    boundary = 1 if conf[cand[0]] < threshold else None
  if boundary is not None and 0 < boundary < len(cand):
    margins.append(conf[cand[boundary - 1]] - conf[cand[boundary]])
  return x0, chosen


def reference_generate(prompt, *, transfer="llada2", threshold=0.95, steps=BLOCK, cache=True, eos=None,
                       margins=None, sink_front=False, editing=None, max_post=16, edit_log=None):
  """Block diffusion of one row at temperature 0 (§6): (tokens [T], decode_step [T − Lp], calls), calls being
  one (computed range, per-layer probabilities, decoded) per model call in order. editing: LLaDA2.1's τ_edit
  (None = LLaDA2.0): at each call the block's decoded non-prompt tokens whose argmax differs with p > τ_edit
  are replaced; a mask-free block is called again while its last call edited, at most max_post times.
  edit_log collects (call index, position) of every edit."""
  margins = [] if margins is None else margins
  lp = len(prompt)
  total = -(-(lp + GEN) // BLOCK) * BLOCK
  x = np.concatenate([prompt, np.full(total - lp, MASK)]).astype(np.int64)
  decode_step = np.full(total - lp, -1)
  n = min(steps, GEN)
  quotas = [BLOCK // n + (1 if j < BLOCK % n else 0) for j in range(n)]
  bound = (n + (max_post if editing is not None else 0)) if transfer == "llada2" else BLOCK
  first, n_blocks = lp // BLOCK, total // BLOCK
  calls, kv = [], None

  def call(start, stop, store, decoded):
    nonlocal kv
    logits, new_kv, probs = np_forward(x, start, stop, kv if cache else None, sink_front)
    calls.append(((start, stop), probs, decoded))
    kv = new_kv if store else kv
    return logits

  if cache and first:
    call(0, first * BLOCK, True, False)  # prefill: the complete prompt blocks
  for k in range(first, n_blocks):
    s, e = k * BLOCK, (k + 1) * BLOCK
    post, edited = 0, False
    for j in range(bound):
      candidates = x[s:e] == MASK
      if not candidates.any() and not (editing is not None and edited and post < max_post):
        break
      logits = call(s, e, False, True) if cache else call(0, e, False, True)[s:]  # SDAR's store_kv=False
      x0, chosen = reference_decide(logits, candidates, transfer, threshold, quotas[min(j, n - 1)], margins)
      edits = []
      if editing is not None:
        conf = _softmax(logits)[np.arange(BLOCK), x0]
        decoded = [i for i in range(BLOCK) if not candidates[i] and s + i >= lp]
        margins.extend(np.abs(conf[decoded] - editing))
        edits = [i for i in decoded if x0[i] != x[s + i] and conf[i] > editing]
        post += int(not candidates.any())
        edited = bool(edits)
      for i in edits:
        x[s + i] = x0[i]
        if edit_log is not None:
          edit_log.append((len(calls) - 1, s + i))
      for i in chosen:
        x[s + i] = x0[i]
        decode_step[s + i - lp] = len(calls) - 1
    if eos is not None and np.any(x[lp:e] == eos):
      break
    if cache and k < n_blocks - 1:
      call(s, e, True, False)  # commit: the finished block's keys and values
  return x, decode_step, calls


CASES = {
    "llada2": dict(threshold=0.9),
    "llada2_quota2": dict(threshold=0.8, steps=4),
    "fast_dllm": dict(transfer="fast_dllm", threshold=0.5),
}


def _options(case, **overrides):
  values = dict(gen_length=GEN, block_length=BLOCK, steps=BLOCK, eos_stop=False)
  values.update(case, **overrides)
  return bd.BlockDiffusionOptions(**values)


def _run(prompt, options, **kwargs):
  return bd.generate(peaked_params(), prompt, config=CONFIG, options=options, **kwargs)


@pytest.mark.parametrize("name, cache", [("llada2", True), ("llada2", False), ("llada2_quota2", True),
                                         ("fast_dllm", True)])
def test_token_step_and_statistics_identical_to_the_reference(name, cache):
  """Tokens, decode steps, nfe, the computed queries, active rows and every step's incoming attention (per
  layer and head, over all T keys) equal the reference's, for two prompts (the second without retracing);
  parallel commits happen. (The rules share the uncached path, so llada2 alone runs without the cache.)"""
  case = CASES[name]
  margins, widest = [], 0
  for row, prompt in enumerate(prompts(2, seed=2)):
    tokens, decode_step, calls = reference_generate(prompt, cache=cache, margins=margins, **case)
    traced = driver.TRACE_COUNTS["block_diffusion"]
    trace = _run(prompt[None], _options(case, cache=cache), stats_spec=PER_HEAD)
    assert row == 0 or driver.TRACE_COUNTS["block_diffusion"] == traced, "a new prompt of the same shape retraced"
    nfe = len(calls)
    np.testing.assert_array_equal(np.asarray(trace.tokens)[0], tokens, err_msg=f"row {row}")
    np.testing.assert_array_equal(np.asarray(trace.decode_step)[0], decode_step, err_msg=f"row {row}")
    assert int(trace.nfe) == nfe
    assert int(trace.row_nfe[0]) == sum(decoded for _, _, decoded in calls)
    np.testing.assert_array_equal(np.asarray(trace.computed_queries)[:nfe], [c[0] for c in calls])
    np.testing.assert_array_equal(np.asarray(trace.active_rows)[:nfe, 0], [c[2] for c in calls])
    incoming = np.asarray(trace.stats["incoming_attention"])  # [max_steps, L, B, N, T]
    assert incoming.shape[-1] == TOTAL and np.all(incoming[nfe:] == 0)
    for step, (_, probs, _) in enumerate(calls):
      for layer, layer_probs in enumerate(probs):
        np.testing.assert_allclose(incoming[step, layer, 0], layer_probs.sum(axis=1), atol=2e-5,
                                   err_msg=f"row {row} step {step} layer {layer}")
    assert np.all(tokens != MASK), "a block was left with masks: the case does not test a full run"
    widest = max(widest, np.bincount(decode_step).max())
  assert min(margins) > 1e-5, "a decision of the reference is within rounding of flipping: change the case"
  assert widest >= 3, f"at most {widest} tokens in one step: parallel decoding not exercised"


def test_cached_equals_uncached_and_its_statistics_add_up():
  """Same tokens; the uncached step of block k (queries [0, e)) has the cached step's statistics (queries
  [s, e)) plus those of the prefill and of the commits before block k (the committed prefix's queries)."""
  options = _options(CASES["llada2"])
  prompt = prompts(2, seed=2)[:1]
  cached = _run(prompt, options, stats_spec=PER_HEAD)
  uncached = _run(prompt, dataclasses.replace(options, cache=False), stats_spec=PER_HEAD)
  np.testing.assert_array_equal(np.asarray(cached.tokens), np.asarray(uncached.tokens))
  active = np.asarray(cached.active_rows)[:int(cached.nfe), 0]
  ranges = np.asarray(cached.computed_queries)[:int(cached.nfe)]
  incoming_cached = np.asarray(cached.stats["incoming_attention"])
  incoming_uncached = np.asarray(uncached.stats["incoming_attention"])
  prefix, uncached_step = np.zeros_like(incoming_cached[0]), 0
  for step in range(int(cached.nfe)):
    if not active[step]:
      prefix = prefix + incoming_cached[step]  # the prefill or a commit: [0, s) as the uncached steps see it
      continue
    np.testing.assert_array_equal(np.asarray(uncached.computed_queries)[uncached_step], [0, ranges[step][1]])
    np.testing.assert_allclose(incoming_uncached[uncached_step], incoming_cached[step] + prefix, atol=2e-5)
    uncached_step += 1
  assert uncached_step == int(uncached.nfe) == int(uncached.row_nfe[0]) == int(cached.row_nfe[0])
  assert int(cached.nfe) == int(uncached.nfe) + 2  # the prefill and block 1's commit (block 2 is the last)


def test_scan_and_python_loops_agree():
  options = _options(CASES["llada2"])
  prompt = prompts(2, seed=3)[:1]
  a = _run(prompt, options, stats_spec=PER_HEAD)
  b = _run(prompt, options, stats_spec=PER_HEAD, loop="python")
  np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
  np.testing.assert_array_equal(np.asarray(a.decode_step), np.asarray(b.decode_step))
  np.testing.assert_array_equal(np.asarray(a.active_rows), np.asarray(b.active_rows))
  np.testing.assert_array_equal(np.asarray(a.computed_queries), np.asarray(b.computed_queries))
  assert int(a.nfe) == int(b.nfe)
  np.testing.assert_allclose(np.asarray(a.stats["incoming_attention"]), np.asarray(b.stats["incoming_attention"]),
                             atol=1e-5)


def test_a_row_alone_and_in_a_padded_batch():
  """At temperature 0.8 with top-k / top-p and per-row keys: a 3-token prompt left-padded by one block (8
  pads) next to an 11-token prompt gets its tokens and row_nfe alone (where it has no prefill and its prompt
  sits in block 0), and so does the long row; the batch waits for its slowest row."""
  options = _options(dict(threshold=0.9), temperature=0.8, top_k=40, top_p=0.95)
  rng = np.random.default_rng(4)
  short, long = rng.integers(3, 200, size=3).astype(np.int32), rng.integers(3, 200, size=LP).astype(np.int32)
  keys = jax.random.split(jax.random.key(7), 2)
  batch = np.stack([np.concatenate([[CONFIG.pad_token_id] * (LP - 3), short]), long]).astype(np.int32)
  mask = np.stack([np.r_[np.zeros(LP - 3), np.ones(3)], np.ones(LP)]).astype(bool)
  together = _run(batch, options, prompt_mask=mask, key=keys)
  alone = [_run(p[None], options, key=k[None]) for p, k in ((short, keys[0]), (long, keys[1]))]
  for row, single in enumerate(alone):
    np.testing.assert_array_equal(np.asarray(together.generated)[row], np.asarray(single.generated)[0])
    assert int(together.row_nfe[row]) == int(single.row_nfe[0])
  assert not np.array_equal(np.asarray(alone[0].generated), np.asarray(alone[1].generated))
  assert int(alone[0].nfe) == int(alone[0].row_nfe[0]) + 1  # the short row alone: no prefill, block 0's commit
  active = np.asarray(together.active_rows)[:int(together.nfe)]
  assert (active[:, 0] != active[:, 1]).any(), "no row waited: the case does not test waiting"


def _decoding_calls(calls, block):
  """How many of the reference's decoding calls worked on block `block`."""
  return sum(decoded and stop == (block + 1) * BLOCK for (_, stop), _, decoded in calls)


def test_eos_stop_after_the_block_that_holds_it():
  """With the EOS id set to a token row 0 commits in block 1 (and row 1 never does): row 0 stops after block
  1 — its block 2 stays masked and it waits — while row 1 runs on; each equals the reference, the batch
  makes the prefill, block 1's steps (its slower row's), block 1's commit and row 1's block-2 steps.
  `answers` cuts at the first EOS (row 0) or at G tokens (row 1)."""
  case = CASES["llada2"]
  prompt = prompts(2, seed=1)
  free = [reference_generate(p, **case) for p in prompt]
  block1 = slice(0, 2 * BLOCK - LP)  # generated positions of block 1
  eos = next(int(t) for t in free[0][0][LP:][block1] if t not in free[1][0][LP:])
  stop0 = reference_generate(prompt[0], eos=eos, **case)
  trace = _run(prompt, _options(case, eos_stop=True, eos_token_id=eos))
  out = np.asarray(trace.generated)
  np.testing.assert_array_equal(np.asarray(trace.tokens), np.stack([stop0[0], free[1][0]]))
  assert np.all(out[0, block1.stop:] == MASK) and np.all(np.asarray(trace.decode_step)[0, block1.stop:] == -1)
  assert int(trace.row_nfe[0]) == _decoding_calls(stop0[2], 1) and _decoding_calls(stop0[2], 2) == 0
  assert int(trace.row_nfe[1]) == _decoding_calls(free[1][2], 1) + _decoding_calls(free[1][2], 2)
  slowest = max(_decoding_calls(stop0[2], 1), _decoding_calls(free[1][2], 1))
  assert int(trace.nfe) == 1 + slowest + 1 + _decoding_calls(free[1][2], 2)
  answer = bd.answers(trace, GEN, eos)
  np.testing.assert_array_equal(answer[0], out[0, :list(out[0]).index(eos) + 1])
  np.testing.assert_array_equal(answer[1], out[1, :GEN])


def test_the_extra_sink_token_at_the_front():
  """*One Token Is Enough*'s sink token as the prompt's first token (its query row, computed at the prefill,
  sees only itself): token- and step-identical to the reference run with the same rule, and different from
  the plain run."""
  case = CASES["llada2"]
  prompt = np.concatenate([[254], prompts(1, seed=7)[0][1:]]).astype(np.int32)
  margins = []
  tokens, decode_step, calls = reference_generate(prompt, margins=margins, sink_front=True, **case)
  plain, _, _ = reference_generate(prompt, **case)
  assert min(margins) > 1e-5
  assert not np.array_equal(tokens, plain), "the sink rule does not change this case: it would not be tested"
  trace = _run(prompt[None], _options(case), intervention=iv.SinkToken())
  np.testing.assert_array_equal(np.asarray(trace.tokens)[0], tokens)
  np.testing.assert_array_equal(np.asarray(trace.decode_step)[0], decode_step)
  assert int(trace.nfe) == len(calls)


def test_sink_masking_and_query_groups_under_the_cache():
  """MaskPreviousSinks: the keys masked at each call are the previous call's top sinks (prefill and commits
  included). Query groups: the prefill has only prompt queries, a commit no masked query."""
  options = _options(CASES["llada2"])
  trace = _run(prompts(1, seed=5), options, intervention=iv.MaskPreviousSinks(top_k=1), sink_top_k=1,
               record_intervention=True, stats_spec=StatsSpec(incoming_attention=True, query_groups=3))
  n = int(trace.nfe)
  record, sinks = np.asarray(trace.intervention_record), np.asarray(trace.top_sinks)  # sinks [steps, L, B, N, 1]
  assert not record[0].any()
  for step in range(1, n):
    masked = np.argwhere(record[step, :, 0])  # (layer, head, key)
    expected = [(l, h, sinks[step - 1, l, 0, h, 0]) for l in range(sinks.shape[1]) for h in range(sinks.shape[3])]
    assert sorted(map(tuple, masked)) == sorted(expected)
  groups = np.asarray(trace.stats["incoming_attention"])[:n, :, 0]  # [steps, L, Q, S]: masked, generated, prompt
  active = np.asarray(trace.active_rows)[:n, 0]
  assert not active[0] and np.all(groups[0, :, :2] == 0) and groups[0, :, 2].sum() > 0
  assert np.all(groups[~active][:, :, 0] == 0)
  assert np.all(groups[active][:, :, 0].sum(axis=(-2, -1)) > 0)


def _forwards_traced(monkeypatch, options):
  """How many model forwards tracing the sampler program of `options` (an 11-token prompt) calls."""
  calls, forward = [], model_call.forward
  monkeypatch.setattr(model_call, "forward", lambda *args, **kwargs: calls.append(1) or forward(*args, **kwargs))
  jax.make_jaxpr(lambda p: bd.generate(p, prompts(1), config=CONFIG, options=options).tokens)(peaked_params())
  return len(calls)


def test_the_cached_run_traces_one_step_whatever_the_number_of_blocks(monkeypatch):
  """With the cache the run is one phase (the block in the carry): 2 and 8 decoded blocks trace the same
  forwards (the prefill, and the step body with the shape probe); without it each block is a phase."""
  counts = {(cache, gen): _forwards_traced(monkeypatch, _options(CASES["llada2"], gen_length=gen, cache=cache))
            for cache in (True, False) for gen in (13, 61)}  # T = 24 and 72: 2 and 8 decoded blocks
  assert counts[True, 13] == counts[True, 61] == 3
  assert (counts[False, 13], counts[False, 61]) == (3, 9)


def test_the_step_cap_and_quota_schedule_follow_llada2():
  options = bd.BlockDiffusionOptions(gen_length=10, block_length=8, steps=32)
  assert options.steps_per_block == 10 and options.quotas == (1,) * 8 + (0, 0)
  assert bd.BlockDiffusionOptions(block_length=32, steps=5).quotas == (7, 7, 6, 6, 6)
  assert bd.BlockDiffusionOptions().step_bound == 32
  assert bd.BlockDiffusionOptions(transfer="fast_dllm", steps=4).step_bound == 32


@pytest.mark.parametrize("config, message", [
    (preset("tiny-llada"), "needs a block-causal model"),
    (preset("tiny-llada").replace(attention_block_size=4), "attention_block_size=4 but block_length=8"),
    (preset("tiny-dream").replace(attention_block_size=8), "logit_shift=1"),
    (CONFIG.replace(mask_token_id=None), "needs a mask token id"),
    (CONFIG.replace(eos_token_id=None), "eos_stop needs an EOS id"),
])
def test_models_it_cannot_run_are_refused(config, message):
  options = bd.BlockDiffusionOptions(gen_length=GEN, block_length=BLOCK, steps=BLOCK)
  with pytest.raises(ValueError, match=message):
    bd.generate(peaked_params(), prompts(1), config=config, options=options)


def test_an_end_sink_token_is_refused_before_tracing():
  from dlm_jax.sampling.driver import TRACE_COUNTS  # pylint: disable=import-outside-toplevel
  traced = TRACE_COUNTS["block_diffusion"]
  with pytest.raises(ValueError, match=r"SinkToken\(position='end'\)"):
    _run(prompts(1), _options(CASES["llada2"]), intervention=iv.Compose((iv.SinkToken(position="end"),)))
  assert TRACE_COUNTS["block_diffusion"] == traced


@pytest.mark.parametrize("values, message", [
    (dict(threshold=1.5), "threshold must be in"),
    (dict(transfer="fast_dllm", threshold=None), "needs a threshold"),
    (dict(transfer="dinfer"), "transfer must be"),
    (dict(steps=0), "steps must be a positive integer"),
    (dict(block_length=2.0), "block_length must be a positive integer"),
    (dict(top_p=0.0), "top_p must be"),
    (dict(top_k=0), "top_k must be"),
    (dict(temperature=-1.0), "temperature must be"),
    (dict(cache="prefix"), "cache and eos_stop must be bools"),
])
def test_bad_options_are_refused(values, message):
  with pytest.raises(ValueError, match=message):
    bd.BlockDiffusionOptions(**values)


@pytest.mark.parametrize("cache", [True, False])
def test_llada21_token_editing_identical_to_the_reference(cache):
  """LLaDA2.1's editing (τ_edit, post steps): tokens, decode steps and nfe equal the reference's, for two
  prompts; edits happen, some of them in post steps on a mask-free block."""
  margins, edits = [], []
  case = dict(threshold=0.9, editing=0.3, max_post=3)
  for prompt in prompts(2, seed=5):
    tokens, decode_step, calls = reference_generate(prompt, cache=cache, margins=margins, edit_log=edits, **case)
    options = _options(dict(threshold=0.9), cache=cache, editing_threshold=0.3, max_post_steps=3)
    trace = _run(prompt[None], options)
    np.testing.assert_array_equal(np.asarray(trace.tokens)[0], tokens)
    np.testing.assert_array_equal(np.asarray(trace.decode_step)[0], decode_step)
    assert int(trace.nfe) == len(calls)
  assert edits, "no token was edited: the case does not test editing"
  assert min(margins) > 1e-5, "a decision of the reference is within rounding of flipping: change the case"
