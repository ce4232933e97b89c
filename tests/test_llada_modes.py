"""LLaDA's block-by-block modes (Fast-dLLM threshold / factor decoding, prefix and dual KV caches) against a
step-by-step NumPy re-implementation of the reference algorithms (`reference/decoding_modes.md` §2–§5),
written here with its own float64 forward and its own per-layer key/value cache."""

import dataclasses
import functools

import jax
import numpy as np
import pytest

from dlm_jax.instrument import interventions as iv
from dlm_jax import model
from dlm_jax.config import preset
from dlm_jax.sampling import llada
from dlm_jax.instrument.stats import StatsSpec
from dlm_jax.sampling.run_setup import RunSetup

jax.config.update("jax_default_matmul_precision", "highest")

CONFIG = preset("tiny-llada")
MASK = CONFIG.mask_token_id
LP, GEN, BLOCK = 5, 16, 8


@functools.lru_cache(maxsize=None)
def peaked_params():
  """Random weights with a scaled LM head, so that many proposals are confident (well above or below τ)."""
  params = model.init_params(CONFIG, jax.random.key(3))
  params["lm_head"]["kernel"] = params["lm_head"]["kernel"] * 6.0
  return params


def prompts(batch=2, seed=0):
  return np.random.default_rng(seed).integers(3, 200, size=(batch, LP)).astype(np.int32)


# ---------------------------------------------------------------- NumPy model with its own KV cache


def _np_params():
  flat = model.flatten_params(peaked_params())
  return {name: np.asarray(value, np.float64) for name, value in flat.items()}


def _rms(x, w):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + CONFIG.norm_eps) * w


def _rope(x, positions):
  """x [T, N, H] rotated (rotate-half) at positions [T]."""
  h = x.shape[-1]
  inv = 1.0 / CONFIG.rope_theta ** (np.arange(0, h, 2) / h)
  ang = positions[:, None] * inv[None, :]
  cos, sin = np.cos(np.concatenate([ang, ang], -1))[:, None], np.sin(np.concatenate([ang, ang], -1))[:, None]
  rot = np.concatenate([-x[..., h // 2:], x[..., :h // 2]], axis=-1)
  return x * cos + rot * sin


def np_forward(p, tokens, start, stop, cache=None, sink_front=False):
  """One row: tokens [S]; computes positions [start, stop). cache: per layer (K, V) [S, N, H] after RoPE,
  read for the positions outside [start, stop) (required unless the range is the whole row).
  sink_front: position 0 is an extra sink token (its query row sees only its own key).
  Returns (logits [stop − start, V], new cache with this call's keys and values written, per-layer
  attention probabilities [N, stop − start, S])."""
  c = CONFIG
  s_len = tokens.shape[0]
  assert cache is not None or (start, stop) == (0, s_len)
  x = p["embed.embedding"][tokens[start:stop]]
  pos = np.arange(start, stop, dtype=np.float64)
  new_cache, probs_all = [], []
  for layer in range(c.n_layers):
    w = lambda name: p[f"blocks.{name}"][layer]
    h = _rms(x, w("attn_norm.weight"))
    q = _rope((h @ w("attn.q.kernel")).reshape(-1, c.n_heads, c.head_dim), pos)
    k = _rope((h @ w("attn.k.kernel")).reshape(-1, c.n_kv_heads, c.head_dim), pos)
    v = (h @ w("attn.v.kernel")).reshape(-1, c.n_kv_heads, c.head_dim)
    keys = np.zeros((s_len, c.n_kv_heads, c.head_dim)) if cache is None else cache[layer][0].copy()
    values = np.zeros_like(keys) if cache is None else cache[layer][1].copy()
    keys[start:stop], values[start:stop] = k, v
    new_cache.append((keys, values))
    scores = np.einsum("tnh,snh->nts", q, keys) / np.sqrt(c.head_dim)
    if sink_front and start == 0:
      scores[:, 0, 1:] = -np.inf
    scores -= scores.max(-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(-1, keepdims=True)
    probs_all.append(probs)
    out = np.einsum("nts,snh->tnh", probs, values).reshape(-1, c.n_heads * c.head_dim)
    x = x + out @ w("attn.o.kernel")
    h = _rms(x, w("mlp_norm.weight"))
    gate = h @ w("mlp.gate.kernel")
    x = x + ((gate / (1 + np.exp(-gate))) * (h @ w("mlp.up.kernel"))) @ w("mlp.down.kernel")
  logits = _rms(x, p["final_norm.weight"]) @ p["lm_head.kernel"]
  return logits, new_cache, probs_all


# ---------------------------------------------------------------- the reference algorithms


def _softmax(x):
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def _order(conf):
  """Candidate order by descending confidence, lowest index first among equals."""
  return sorted(range(len(conf)), key=lambda j: (-conf[j], j))


def reference_transfer(conf, candidates, rule, value, quota, factor_rule="dllm", events=None, key=None):
  """Indices (within the window) to transfer. conf [W] float64, candidates [W] bool; key [W]: the ranking
  (default conf). events (a list) collects "only_last_fails" when the factor rule's first failing rank is
  the last one."""
  cand = [j for j in _order(conf if key is None else key) if candidates[j]]
  if rule == "threshold":
    return cand[:1] + [j for j in cand[1:] if conf[j] >= value]
  if rule == "factor" and factor_rule == "fast_dllm":
    # NVlabs' loop: bounds -1, 1 - f/3, 1 - f/4, ...; stop at the first failing rank; then one more when
    # the loop ended on the first or the last rank.
    n = len(cand)
    bounds = [-1.0] + [1.0 - value / (r + 1) for r in range(2, n + 1)]
    top = n - 1
    for i in range(n):
      if conf[cand[i]] < bounds[i]:
        top = i
        break
    if events is not None and top == n - 1 and conf[cand[n - 1]] < bounds[n - 1]:
      events.append("only_last_fails")
    if top in (0, n - 1):
      top += 1
    return cand[:top]
  if rule == "factor":
    chosen = cand[:1]
    for r, j in enumerate(cand[1:], start=2):
      if conf[j] < 1.0 - value / (r + 1):
        break
      chosen.append(j)
    return chosen
  return cand[:quota]


def reference_generate(p, prompt, *, rule, value=None, cache="none", steps=GEN, gen=GEN, block=BLOCK,
                       margins=None, sink_front=False, factor_rule="dllm", capped=False, events=None,
                       log_odds=False):
  """Fast-dLLM decoding of one row at temperature 0 (§2–§5): (tokens, decode_step, nfe, per-step
  (computed range, attention probabilities)). `margins` collects, at each step, how far the decision was
  from flipping: the confidence gap between the last transferred and the first kept candidate (every rule
  transfers a prefix of the descending order) and, for the threshold, |confidence − τ|.
  capped: the dual cache of NVlabs' current code — at most steps / num_blocks calls per block, and the
  refresh's candidates are every mask before the block's end (earlier blocks' leftovers included).
  log_odds: rank by log p − log(1 − p) = l_x0 − logsumexp(other logits), in float64 (the exact order)."""
  x = np.concatenate([prompt, np.full(gen, MASK)]).astype(np.int64)
  s_len = x.shape[0]
  decode_step = np.full(gen, -1)
  spb = steps // (gen // block)
  nfe, calls = 0, []

  def decode(logits, positions, quota):
    nonlocal nfe
    candidates = x[positions] == MASK
    x0 = logits.argmax(-1)
    conf = _softmax(logits)[np.arange(len(positions)), x0]
    key = None
    if log_odds:
      others = np.where(np.arange(logits.shape[-1]) == x0[:, None], -np.inf, logits)
      top = others.max(-1, keepdims=True)
      key = logits[np.arange(len(positions)), x0] - (top[:, 0] + np.log(np.exp(others - top).sum(-1)))
    chosen = reference_transfer(conf, candidates, rule, value, quota, factor_rule, events, key)
    ranked = sorted(conf[candidates], reverse=True)
    if margins is not None and 0 < len(chosen) < len(ranked):
      margins.append(ranked[len(chosen) - 1] - ranked[len(chosen)])
    if margins is not None and rule == "threshold":
      margins.extend(np.abs(conf[candidates] - value))
    for j in chosen:
      x[positions[j]] = x0[j]
      decode_step[positions[j] - len(prompt)] = nfe
    nfe += 1

  for k in range(gen // block):
    s = len(prompt) + k * block
    e = s + block
    bound = spb if rule == "quota" or capped else block
    block_positions = np.arange(s, e)
    taken, quotas, kv = 0, None, None
    while taken < bound and np.any(x[s:e] == MASK):
      if quotas is None:
        m = int(np.sum(x[s:e] == MASK))
        quotas = [m // spb + (1 if j < m % spb else 0) for j in range(spb)]
      if cache == "none" or kv is None:
        logits, kv, probs = np_forward(p, x, 0, s_len, sink_front=sink_front)
        calls.append(((0, s_len), probs))
        if capped:
          decode(logits[:e], np.arange(e), quotas[taken])
        else:
          decode(logits[s:e], block_positions, quotas[taken])
      elif cache == "prefix":
        logits, _, probs = np_forward(p, x, s, s_len, kv, sink_front)  # the prefix cache is not modified
        calls.append(((s, s_len), probs))
        decode(logits[:block], block_positions, quotas[taken])
      else:
        logits, kv, probs = np_forward(p, x, s, e, kv, sink_front)  # the block's keys and values written in place
        calls.append(((s, e), probs))
        decode(logits, block_positions, quotas[taken])
      taken += 1
  return x, decode_step, nfe, calls


CASES = {
    "threshold": dict(options=dict(threshold=0.9), rule="threshold", value=0.9),
    "threshold_low": dict(options=dict(threshold=0.5), rule="threshold", value=0.5),
    "factor": dict(options=dict(factor=1.0, factor_rule="dllm"), rule="factor", value=1.0),
    "prefix_quota": dict(options=dict(cache="prefix"), rule="quota", cache="prefix"),
    "dual_quota": dict(options=dict(cache="dual", steps=8), rule="quota", cache="dual", steps=8),
    "threshold_prefix": dict(options=dict(threshold=0.9, cache="prefix"), rule="threshold", value=0.9,
                             cache="prefix"),
    "threshold_dual": dict(options=dict(threshold=0.7, cache="dual"), rule="threshold", value=0.7, cache="dual"),
    "factor_dual": dict(options=dict(factor=2.0, cache="dual", factor_rule="dllm"), rule="factor", value=2.0,
                        cache="dual"),
}
"""The factor cases select dllm's rule explicitly (the default is NVlabs'; `NVLABS_CASES`)."""

NVLABS_CASES = {
    "factor_nvlabs": dict(options=dict(factor=1.0), rule="factor", value=1.0, factor_rule="fast_dllm"),
    "factor_nvlabs_dual": dict(options=dict(factor=2.0, cache="dual"), rule="factor", value=2.0, cache="dual",
                               factor_rule="fast_dllm"),
    "threshold_dual_capped": dict(options=dict(threshold=0.9, cache="dual", steps=4,
                                               dual_cache_forwards="steps_per_block"),
                                  rule="threshold", value=0.9, cache="dual", steps=4, capped=True),
    "factor_dual_capped": dict(options=dict(factor=1.0, cache="dual", steps=4, dual_cache_forwards="steps_per_block"),
                               rule="factor", value=1.0, cache="dual", steps=4, capped=True, factor_rule="fast_dllm"),
}
"""NVlabs' current code: its factor rule (the default) and the dual cache's per-block cap."""


def _options(case):
  values = dict(gen_length=GEN, steps=GEN, block_length=BLOCK)
  values.update(case["options"])
  return llada.LLaDAOptions(**values)


STATS = RunSetup(stats_spec=StatsSpec(incoming_attention=True, per_head=True))
STATS_CASES = ("threshold_dual", "prefix_quota")
"""The cases whose statistics `test_statistics_are_the_computed_queries_attention_over_all_keys` checks: every test
runs them with `STATS`, so that the tests of a case share its compiled program (issue 38)."""


def _reference(case, prompt, margins=None, sink_front=False, events=None):
  kwargs = {k: case[k] for k in ("value", "cache", "steps", "factor_rule", "capped") if k in case}
  return reference_generate(_np_params(), prompt, rule=case["rule"], margins=margins, sink_front=sink_front,
                            events=events, **kwargs)


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_mode_is_token_and_step_identical_to_the_reference(name):
  case = CASES[name]
  margins, widest = [], 0
  setup = STATS if name in STATS_CASES else RunSetup()
  for row, prompt in enumerate(prompts(2, seed=1)):
    tokens, decode_step, nfe, _ = _reference(case, prompt, margins)
    trace = llada.generate(peaked_params(), prompt[None], config=CONFIG, options=_options(case), setup=setup)
    np.testing.assert_array_equal(np.asarray(trace.tokens)[0], tokens, err_msg=f"{name} row {row}")
    np.testing.assert_array_equal(np.asarray(trace.decode_step)[0], decode_step, err_msg=f"{name} row {row}")
    assert int(trace.nfe) == nfe == int(trace.row_nfe[0])
    widest = max(widest, np.bincount(decode_step).max())
  assert min(margins) > 1e-5, "a decision of the reference is within rounding of flipping: change the case"
  if case["rule"] != "quota":
    assert widest >= 3, f"{name}: at most {widest} tokens in one step, parallel decoding not exercised"


@pytest.mark.parametrize("name", STATS_CASES)
def test_statistics_are_the_computed_queries_attention_over_all_keys(name):
  """Incoming attention per step, layer and head = the reference's probabilities of the computed queries
  summed over those queries, cached keys included; computed_queries names the range."""
  case = CASES[name]
  prompt = prompts(1, seed=6)[0]
  margins = []
  _, _, nfe, calls = _reference(case, prompt, margins)
  assert min(margins) > 1e-5
  trace = llada.generate(peaked_params(), prompt[None], config=CONFIG, options=_options(case), setup=STATS)
  incoming = np.asarray(trace.stats["incoming_attention"])  # [max_steps, L, B, N, S]
  assert incoming.shape[0] == GEN  # max_steps: two blocks of at most 8 steps
  assert np.all(incoming[nfe:] == 0)
  np.testing.assert_array_equal(np.asarray(trace.computed_queries)[:nfe], [c[0] for c in calls])
  for step, (_, probs) in enumerate(calls):
    for layer, layer_probs in enumerate(probs):
      np.testing.assert_allclose(incoming[step, layer, 0], layer_probs.sum(axis=1), atol=2e-5,
                                 err_msg=f"step {step} layer {layer}")


def waiting_batch():
  """(options, [2, Lp] left-padded prompts, prompt mask, [2] row keys, the two rows' own prompts): threshold 0.7
  with the dual cache at temperature 0.8, a batch whose rows wait for each other."""
  options = _options(dict(options=dict(threshold=0.7, cache="dual", temperature=0.8, padding="key",
                                       shift_positions=True)))
  rng = np.random.default_rng(4)
  short, long = rng.integers(3, 200, size=3), rng.integers(3, 200, size=LP)
  keys = jax.random.split(jax.random.key(7), 2)
  batch = np.stack([np.concatenate([[CONFIG.pad_token_id] * (LP - 3), short]), long]).astype(np.int32)
  mask = np.stack([np.r_[np.zeros(LP - 3), np.ones(3)], np.ones(LP)]).astype(bool)
  return options, batch, mask, keys, (short.astype(np.int32), long.astype(np.int32))


@pytest.mark.parametrize("name", ["waiting_batch", "prefix_quota"])
def test_scan_and_python_loops_agree(name):
  """The compiled and the Python loop on the waiting batch (the dual cache's one phase; padding, per-row keys at
  temperature 0.8, rows that wait) and on prefix_quota (a phase per block); the compiled run of each is another
  test's program (`test_rows_wait_for_the_batch_and_keep_their_own_results`, the statistics test)."""
  if name == "waiting_batch":
    options, prompt, mask, keys, _ = waiting_batch()
    inputs = dict(prompt_mask=mask, key=keys)
  else:
    options, prompt, inputs = _options(CASES[name]), prompts(1, seed=6), {}
  a = llada.generate(peaked_params(), prompt, config=CONFIG, options=options, setup=STATS, **inputs)
  b = llada.generate(peaked_params(), prompt, config=CONFIG, options=options,
                     setup=dataclasses.replace(STATS, loop="python"), **inputs)
  np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
  np.testing.assert_array_equal(np.asarray(a.active_rows), np.asarray(b.active_rows))
  assert int(a.nfe) == int(b.nfe)
  np.testing.assert_allclose(np.asarray(a.stats["incoming_attention"]), np.asarray(b.stats["incoming_attention"]),
                             atol=1e-5)


def test_rows_wait_for_the_batch_and_keep_their_own_results():
  """Each row of a left-padded batch at temperature 0.8 with per-row keys: the tokens and row_nfe it gets
  alone; the batch runs as many steps per block as its slowest row; waiting rows are inactive."""
  options, batch, mask, keys, rows = waiting_batch()
  together = llada.generate(peaked_params(), batch, config=CONFIG, options=options, prompt_mask=mask, key=keys,
                            setup=STATS)
  alone = [llada.generate(peaked_params(), p[None], config=CONFIG, options=options, key=k[None])
           for p, k in zip(rows, keys)]
  for row, single in enumerate(alone):
    np.testing.assert_array_equal(np.asarray(together.generated)[row], np.asarray(single.generated)[0])
    assert int(together.row_nfe[row]) == int(single.nfe)
  assert int(together.nfe) >= max(int(s.nfe) for s in alone)
  assert not np.all(np.asarray(together.active_rows)[:int(together.nfe)])


def sink_masking_run(cache):
  """Keywords of a run under previous-step sink masking (threshold 0.7, blocks of 4), with the top sinks and the
  masks recorded: the options and setup both sink masking tests use, so that they share compiled programs."""
  options = llada.LLaDAOptions(gen_length=GEN, steps=GEN, block_length=4, threshold=0.7, cache=cache)
  setup = RunSetup(intervention=iv.MaskPreviousSinks(top_k=1), sink_top_k=1, record_intervention=True)
  return dict(config=CONFIG, options=options, setup=setup)


@pytest.mark.parametrize("cache", ["none", "dual"])
def test_waiting_rows_keep_their_sink_masker_state(cache):
  """Under previous-step sink masking a row that waits for its batch keeps the sinks of its own last step
  (`Intervention.keep_rows`): each of 6 rows decodes as it does alone (3–6 of them differ when waiting
  calls update the state)."""
  batch = prompts(6, seed=11)
  run = sink_masking_run(cache)
  together = llada.generate(peaked_params(), batch, **run)
  assert not np.all(np.asarray(together.active_rows)[:int(together.nfe)]), "no row waited"
  for row in range(batch.shape[0]):
    alone = llada.generate(peaked_params(), batch[row:row + 1], **run)
    np.testing.assert_array_equal(np.asarray(together.tokens)[row], np.asarray(alone.tokens)[0], err_msg=f"row {row}")


def test_sink_masking_runs_under_the_dual_cache():
  """MaskPreviousSinks composes with a cached mode: the masked keys recorded at each step are the previous
  step's top sinks of the computed queries."""
  trace = llada.generate(peaked_params(), prompts(1, seed=5), **sink_masking_run("dual"))
  n = int(trace.nfe)
  record = np.asarray(trace.intervention_record)
  assert record.shape[0] >= n and not record[0].any()
  sinks = np.asarray(trace.top_sinks)  # [max_steps, L, B, N, 1]
  for step in range(1, n):
    masked = np.argwhere(record[step, :, 0])  # (layer, head, key)
    expected = [(l, h, sinks[step - 1, l, 0, h, 0]) for l in range(sinks.shape[1]) for h in range(sinks.shape[3])]
    assert sorted(map(tuple, masked)) == sorted(expected)


@pytest.mark.parametrize("name", ["threshold_dual", "threshold_prefix"])
def test_the_extra_sink_token_composes_with_the_caches(name):
  """*One Token Is Enough*'s sink token at position 0 (its query row sees only itself) under a cached mode:
  token- and step-identical to the reference run with the same attention rule."""
  case = CASES[name]
  sink_id = 254
  prompt = np.concatenate([[sink_id], prompts(1, seed=7)[0][1:]]).astype(np.int32)
  margins = []
  tokens, decode_step, nfe, _ = _reference(case, prompt, margins, sink_front=True)
  plain, _, _, _ = _reference(case, prompt)
  assert min(margins) > 1e-5
  assert not np.array_equal(tokens, plain), "the sink rule does not change this case: it would not be tested"
  trace = llada.generate(peaked_params(), prompt[None], config=CONFIG, options=_options(case),
                         setup=RunSetup(intervention=iv.SinkToken()))
  np.testing.assert_array_equal(np.asarray(trace.tokens)[0], tokens)
  np.testing.assert_array_equal(np.asarray(trace.decode_step)[0], decode_step)
  assert int(trace.nfe) == nfe


@pytest.mark.parametrize("values, message", [
    (dict(threshold=1.5), "threshold must be in"),
    (dict(factor=0.0), "factor must be > 0"),
    (dict(threshold=0.9, factor=1.0), "not both"),
    (dict(cache="full"), "cache must be"),
    (dict(cache="dual", cfg_scale=1.0), "cannot be combined with cfg_scale"),
])
def test_bad_mode_options_are_refused(values, message):
  with pytest.raises(ValueError, match=message):
    llada.LLaDAOptions(gen_length=GEN, steps=GEN, block_length=BLOCK, **values)


@pytest.mark.parametrize("name", sorted(NVLABS_CASES))
def test_nvlabs_rules_are_token_and_step_identical_to_the_reference(name):
  """NVlabs' factor rule (all candidates when only the last fails) and the dual cache's per-block cap
  (steps / num_blocks calls; leftovers compete at later refreshes) against the step-by-step reference."""
  case = NVLABS_CASES[name]
  margins, events, leftovers = [], [], 0
  for row, prompt in enumerate(prompts(3, seed=1)):
    tokens, decode_step, nfe, _ = _reference(case, prompt, margins, events=events)
    trace = llada.generate(peaked_params(), prompt[None], config=CONFIG, options=_options(case))
    np.testing.assert_array_equal(np.asarray(trace.tokens)[0], tokens, err_msg=f"{name} row {row}")
    np.testing.assert_array_equal(np.asarray(trace.decode_step)[0], decode_step, err_msg=f"{name} row {row}")
    assert int(trace.nfe) == nfe == int(trace.row_nfe[0])
    spb = case.get("steps", GEN) // (GEN // BLOCK)
    leftovers += int(np.sum(decode_step[:BLOCK] >= spb)) + int(np.sum(tokens[LP:] == MASK))
  assert min(margins) > 1e-5, "a decision of the reference is within rounding of flipping: change the case"
  if case.get("factor_rule") == "fast_dllm":
    assert "only_last_fails" in events, f"{name}: NVlabs' extra commit never happened"
  if case.get("capped"):
    assert leftovers > 0, f"{name}: no block was left unfinished by the cap"


@functools.lru_cache(maxsize=None)
def saturated_params():
  """A strongly scaled LM head: most proposals have p within 6e-8 of 1, exactly 1.0 in float32."""
  params = model.init_params(CONFIG, jax.random.key(3))
  params["lm_head"]["kernel"] = params["lm_head"]["kernel"] * 40.0
  return params


def test_log_odds_ranking_gives_the_exact_order_where_float32_probabilities_tie():
  """Exact LLaDA decoding (quota rule, blocks of 8) and the threshold rule ranked by log odds are token- and
  step-identical to the float64 reference ranked by log odds; ranked by float32 probability (the
  originals' rule) the saturated confidences tie and the order differs."""
  flat = {name: np.asarray(value, np.float64) for name, value in model.flatten_params(saturated_params()).items()}
  differs = 0
  for case in (CASES["prefix_quota"], CASES["threshold"]):
    case = dict(case, options=dict(case["options"], cache="none"), cache="none")
    for prompt in prompts(2, seed=5):
      kwargs = {k: case[k] for k in ("value",) if k in case}
      tokens, decode_step, nfe, _ = reference_generate(flat, prompt, rule=case["rule"], log_odds=True, **kwargs)
      options = dict(case["options"], gen_length=GEN, steps=GEN, block_length=BLOCK)
      exact = llada.generate(saturated_params(), prompt[None], config=CONFIG,
                             options=llada.LLaDAOptions(confidence_ranking="log_odds", **options))
      np.testing.assert_array_equal(np.asarray(exact.tokens)[0], tokens)
      np.testing.assert_array_equal(np.asarray(exact.decode_step)[0], decode_step)
      assert int(exact.nfe) == nfe
      official = llada.generate(saturated_params(), prompt[None], config=CONFIG, options=llada.LLaDAOptions(**options))
      differs += not np.array_equal(np.asarray(official.decode_step)[0], decode_step)
  assert differs, "float32 probabilities did not saturate in any case: the comparison would not be tested"
