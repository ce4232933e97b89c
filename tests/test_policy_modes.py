"""Compute policies with parallel decoding and the decoding rules (issue 36 item 3): the block a policy sees is
the sampler's (a threshold block takes a variable number of calls), dKV-Cache and Sparse-dLLM under threshold
decoding against a whole-run replay written here (a Python loop over an independent NumPy forward, the rules
in NumPy), a policy that recomputes every position gives the plain sampler's tokens, rows decode alone as in
their batch, and every combination a policy cannot run is refused in one line before any compilation."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlm_jax import model
from dlm_jax.config import preset
from dlm_jax.instrument.hook_spec import Capture, Hooks
from dlm_jax.policy.base import ComputePolicy, Decision, RunLayout
from dlm_jax.policy.registry import parse_policy
from dlm_jax.sampling import decoding_rules, dream, driver, llada, schedules
from dlm_jax.session import decoding_mode
from dlm_jax.session.errors import SessionError
from dlm_jax.sampling.run_setup import RunSetup

try:
  from tests import numpy_transformer as ref
  from tests import test_dream_modes as dream_ref
  from tests.threshold_replay import threshold_commits
except ImportError:  # run from inside tests/
  import numpy_transformer as ref
  import test_dream_modes as dream_ref
  from threshold_replay import threshold_commits

jax.config.update("jax_default_matmul_precision", "highest")

CONFIG = preset("tiny-llada")
MASK = CONFIG.mask_token_id
LP, GEN, BLOCK, TAU = 5, 16, 8, 0.9
THRESHOLD = llada.LLaDAOptions(gen_length=GEN, steps=GEN, block_length=BLOCK, threshold=TAU)
DKV = "dkv_cache:cache_reloading_step=3"
DKV_BUCKETS = (2, 4, 8, 16)
"""dKV-Cache's static row counts here: its budget, the GEN generated positions, and its halves."""
SPARSE = "sparse_dllm:keep_ratio=0.5,tie_break=lowest_position"


@functools.lru_cache(maxsize=None)
def peaked_params():
  """Random weights with a scaled LM head: some proposals are confident, so blocks take 3 to 8 calls."""
  params = model.init_params(CONFIG, jax.random.key(3))
  params["lm_head"]["kernel"] = params["lm_head"]["kernel"] * 6.0
  return params


def prompts():
  return np.random.default_rng(1).integers(3, 200, size=(2, LP)).astype(np.int32)


@functools.lru_cache(maxsize=None)
def generate(policy_text, rows, batch_invariant=False):
  """The threshold sampler under a policy on prompts()[rows] (rows: a tuple of row indices)."""
  return llada.generate(peaked_params(), prompts()[list(rows)], config=CONFIG, options=THRESHOLD,
                        setup=RunSetup(policy=parse_policy(policy_text), batch_invariant=batch_invariant))


# ---------------------------------------------------------------- the replay


def _kept_keys(sites, s):
  """Sparse-dLLM's kept keys per layer (NumPy): the head mean of the block-mean post-RoPE query . every key, the
  keys outside [s, s + BLOCK) laid end to end, max-pooled (kernel 3, -inf padding), the top half kept (ties:
  lowest position first), ascending."""
  total = LP + GEN
  positions = np.arange(total, dtype=np.float64)
  outside = np.array([j for j in range(total) if not s <= j < s + BLOCK])
  n_keep = int(len(outside) * 0.5)
  kept = []
  for layer in range(CONFIG.n_layers):
    q = ref._rope(sites[f"blocks.{layer}.attn.hook_q"], positions, CONFIG.rope_theta)[0]  # [S, N, H]
    k = ref._rope(sites[f"blocks.{layer}.attn.hook_k"], positions, CONFIG.rope_theta)[0]  # [S, K, H]
    group = CONFIG.n_heads // CONFIG.n_kv_heads
    q_mean = q[s:s + BLOCK].mean(axis=0)
    scores = np.mean([k[:, h // group] @ q_mean[h] for h in range(CONFIG.n_heads)], axis=0)
    padded = np.concatenate([[-np.inf], scores[outside], [-np.inf]])
    pooled = np.max([padded[j:j + len(outside)] for j in range(3)], axis=0)
    order = sorted(range(len(outside)), key=lambda j: (-pooled[j], j))
    kept.append(np.sort(outside[order[:n_keep]]))
  return kept


def replay(prompt, method, margins):
  """One row of Fast-dLLM threshold decoding (τ = TAU, blocks of BLOCK, at most BLOCK calls a block) under
  `method` ("dkv_cache" with reload interval 3 or "sparse_dllm" at keep ratio 0.5), every call through the
  NumPy forward: (tokens [S], decode_step [G], nfe, computed [nfe, S] bool, kept {call: [L][n_keep]}).

  A block's calls 0 and 1 (dKV-Cache also every third) run the whole sequence and rewrite the cache; the others
  run dKV-Cache's positions masked at the previous call's input, or Sparse-dLLM's block over the keys it kept at
  call 1, every other position's keys and values from the cache. `margins` collects |confidence − τ| of every
  candidate and the gap between the two most confident."""
  x = np.concatenate([prompt, np.full(GEN, MASK)]).astype(np.int64)
  total = len(x)
  decode_step = np.full(GEN, -1)
  nfe, computed, kept_at, cache, was_masked, kept = 0, [], {}, None, None, None
  for start in range(LP, total, BLOCK):
    step = 0
    while step < BLOCK and np.any(x[start:start + BLOCK] == MASK):
      full = step <= 1 or (method == "dkv_cache" and step % 3 == 0)
      if full:
        logits, sites = ref.forward_sites(peaked_params(), x[None], CONFIG)
        cache = ref.cached_kv(peaked_params(), x[None], CONFIG)
        queries = np.arange(total)
        if method == "sparse_dllm" and step == 1:
          kept = _kept_keys(sites, start)
      else:
        if method == "dkv_cache":
          queries = np.flatnonzero(was_masked & (np.arange(total) >= LP))
          keys = None
        else:
          queries = np.arange(start, start + BLOCK)
          keys = [layer_keys[None] for layer_keys in kept]
        rows, cache = ref.subset_forward(peaked_params(), x[None], CONFIG, cache, queries[None], keys,
                                         return_cache=True)
        logits = np.zeros((1, total, CONFIG.vocab_size))
        logits[0, queries] = rows[0]
      if method == "sparse_dllm" and step >= 1:
        kept_at[nfe] = kept
      computed.append(np.isin(np.arange(total), queries))
      was_masked = x == MASK
      candidates = np.flatnonzero(x[start:start + BLOCK] == MASK) + start
      assert np.all(np.isin(candidates, queries)), "a candidate's logits were not computed"
      chosen, x0 = threshold_commits(logits[0, candidates], TAU, margins)
      for j in chosen:
        x[candidates[j]] = x0[j]
        decode_step[candidates[j] - LP] = nfe
      nfe += 1
      step += 1
  return x, decode_step, nfe, np.array(computed), kept_at


@pytest.mark.parametrize("text, method", [(DKV, "dkv_cache"), (SPARSE, "sparse_dllm")])
def test_threshold_decoding_under_a_policy_is_the_replay(text, method):
  margins, lengths, buckets_ran = [], set(), set()
  for row, prompt in enumerate(prompts()):
    tokens, decode_step, nfe, computed, kept_at = replay(prompt, method, margins)
    trace = generate(text, (row,))
    np.testing.assert_array_equal(np.asarray(trace.tokens)[0], tokens, err_msg=f"{method} row {row}")
    np.testing.assert_array_equal(np.asarray(trace.decode_step)[0], decode_step, err_msg=f"{method} row {row}")
    assert int(trace.nfe) == nfe
    np.testing.assert_array_equal(np.asarray(trace.computed_positions)[:nfe, 0], computed)
    for call, kept in kept_at.items():
      np.testing.assert_array_equal(np.asarray(trace.policy_record)[call, 0], np.stack(kept), err_msg=f"call {call}")
    if method == "dkv_cache":  # a cached call runs at the smallest bucket holding its count
      ran = np.asarray(trace.policy_record["rows"])[:nfe, 0]
      np.testing.assert_array_equal(ran, _dkv_rows(computed), err_msg=f"row {row}")
      buckets_ran |= set(ran.tolist())
    lengths |= {int(decode_step[:BLOCK].max() - decode_step[:BLOCK].min() + 1),
                int(decode_step[BLOCK:].max() - decode_step[BLOCK:].min() + 1)}
  assert min(margins) > 1e-4, "a decision of the replay is within rounding of flipping: change the case"
  assert len(lengths) > 1 and max(lengths) >= 4, f"block lengths {lengths}: variable blocks not exercised"
  skipped = ~np.asarray(trace.computed_positions)[:int(trace.nfe), 0]
  assert skipped.any(), "no call skipped a position"
  if method == "dkv_cache":
    assert len(buckets_ran - {LP + GEN}) > 1, f"rows {buckets_ran}: fewer than two buckets exercised"


def _dkv_rows(computed):
  """[calls] the rows each call of a replay ran: S at a full call, else the smallest of DKV_BUCKETS holding its
  computed positions (computed [calls, S] bool)."""
  return np.array([len(c) if c.all() else min(b for b in DKV_BUCKETS if b >= c.sum()) for c in computed])


def test_a_row_decodes_alone_as_in_its_batch_under_threshold_decoding():
  """The batch-invariant batch of both rows (a row waits while the other finishes its block): each row's tokens,
  computed positions (at its own calls) and bucket rows are those of the row alone (the runs the replay test
  checks) and of the replay."""
  both = generate(DKV, (0, 1), batch_invariant=True)
  active = np.asarray(both.active_rows)[:int(both.nfe)]
  assert not active.all(), "no row waited for the batch"
  ran = {}
  for row in range(2):
    alone = generate(DKV, (row,))
    in_batch = np.asarray(both.computed_positions)[:int(both.nfe), row][active[:, row]]
    np.testing.assert_array_equal(np.asarray(alone.tokens)[0], np.asarray(both.tokens)[row])
    np.testing.assert_array_equal(np.asarray(alone.computed_positions)[:int(alone.nfe), 0], in_batch)
    tokens, _, _, computed, _ = replay(prompts()[row], "dkv_cache", [])
    np.testing.assert_array_equal(np.asarray(both.tokens)[row], tokens)
    np.testing.assert_array_equal(in_batch, computed)
    ran[row] = np.asarray(both.policy_record["rows"])[:int(both.nfe), row]  # each row at its own count's bucket
    np.testing.assert_array_equal(ran[row][active[:, row]], _dkv_rows(computed))
    np.testing.assert_array_equal(np.asarray(alone.policy_record["rows"])[:int(alone.nfe), 0], _dkv_rows(computed))
  both_active = active.all(-1)
  assert (ran[0][both_active] != ran[1][both_active]).any(), "no call ran its rows at different buckets"


# ---------------------------------------------------------------- recomputing everything


@dataclasses.dataclass(frozen=True)
class Everything(ComputePolicy):
  """A test policy: every call takes the query subset of every position (the subset path, nothing reused)."""

  NAME = "everything"

  def decide(self, state, context):
    index = jnp.arange(self.layout.seq_len, dtype=jnp.int32)
    return Decision(full=jnp.zeros((), bool), queries=jnp.broadcast_to(index, context.tokens.shape))


SMALL = dict(gen_length=8, steps=8, block_length=4)


@pytest.mark.parametrize("sample, options", [
    (llada.generate, llada.LLaDAOptions(**SMALL, factor=1.0)),
    (llada.generate, llada.LLaDAOptions(**SMALL, rule=decoding_rules.EBSampler())),
    (dream.diffusion_generate, dream.DreamOptions(**SMALL, threshold=0.9)),
])
def test_recomputing_every_position_gives_the_plain_sampler(sample, options):
  config = preset("tiny-dream" if sample is dream.diffusion_generate else "tiny-llada")
  params = model.init_params(config, jax.random.key(3))
  prompt = prompts()
  plain = sample(params, prompt, config=config, options=options)
  policy = sample(params, prompt, config=config, options=options, setup=RunSetup(policy=Everything()))
  np.testing.assert_array_equal(policy.tokens, plain.tokens)
  np.testing.assert_array_equal(policy.decode_step, plain.decode_step)
  assert int(policy.nfe) == int(plain.nfe)
  assert np.asarray(policy.computed_positions)[:int(policy.nfe)].all()


def test_sparse_dllm_on_dreams_block_modes_computes_the_block_and_the_position_before_after_two_calls():
  config = preset("tiny-dream")
  params = model.init_params(config, jax.random.key(3))
  options = dream.DreamOptions(gen_length=8, steps=8, block_length=4, threshold=0.9)
  trace = dream.diffusion_generate(params, prompts(), config=config, options=options,
                                   setup=RunSetup(policy=parse_policy(SPARSE)))
  decoded_at = np.asarray(trace.decode_step)  # [B, G]: the block-start call commits a block's first position
  starts = sorted(int(decoded_at[0, k]) for k in range(0, 8, 4))
  for call, computed in enumerate(np.asarray(trace.computed_positions)[:int(trace.nfe)]):
    block = max(k for k, first in enumerate(starts) if first <= call)
    if call - starts[block] <= 1:
      assert computed.all(), call
    else:
      expected = np.isin(np.arange(LP + 8), LP + 4 * block + np.arange(-1, 4))  # the block and the position before
      np.testing.assert_array_equal(computed, np.broadcast_to(expected, computed.shape), err_msg=f"call {call}")


# ---------------------------------------------------------------- refusals


def _refused_runs():
  """(model, run(params, prompt), message) of each combination a policy cannot run."""
  dkv = parse_policy("dkv_cache")
  dream_config = preset("tiny-dream")
  return [
      ("tiny-llada", lambda p, x: llada.generate(p, x, config=CONFIG, options=llada.LLaDAOptions(**SMALL, cache="dual"),
                                                 setup=RunSetup(policy=parse_policy("dllm_cache"))),
       "policy 'dllm_cache' does not compose with cache='dual'"),
      ("tiny-llada", lambda p, x: llada.generate(p, x, config=CONFIG, setup=RunSetup(policy=dkv),
                                                 options=llada.LLaDAOptions(**SMALL, threshold=0.9, cache="prefix")),
       "policy 'dkv_cache' does not compose with cache='prefix'"),
      ("tiny-llada", lambda p, x: llada.generate(p, x, config=CONFIG, setup=RunSetup(policy=dkv),
                                                 options=llada.LLaDAOptions(**SMALL, rule=decoding_rules.WINO())),
       "policy 'dkv_cache' does not run with decoding rule wino"),
      ("tiny-dream", lambda p, x: dream.diffusion_generate(p, x, config=dream_config, setup=RunSetup(policy=dkv),
                                                           options=dream.DreamOptions(**SMALL, threshold=0.9,
                                                                                      cache="dual")),
       "policy 'dkv_cache' does not compose with cache='dual'"),
      ("tiny-llada", lambda p, x: llada.generate(p, x, config=CONFIG, options=llada.LLaDAOptions(**SMALL),
                                                 setup=RunSetup(policy=parse_policy("dkv_cache:shift_type=right"))),
       "dkv_cache cache_type and shift_type are the rules of Dream's code"),
      ("tiny-dream", lambda p, x: dream.diffusion_generate(p, x, config=dream_config,
                                                           options=dream.DreamOptions(
                                                               **SMALL, rule=decoding_rules.EBSampler()),
                                                           setup=RunSetup(
                                                               policy=parse_policy("elastic_cache"),
                                                               hooks=Hooks(captures=(Capture("hook_resid_post"),)))),
       "policy elastic_cache runs with the llada, llada_blockwise, dream, dream_blockwise, dream_window samplers .* "
       "not dream_rules"),
  ]


@pytest.mark.parametrize("index", range(6))
def test_combinations_a_policy_cannot_run_are_refused_before_compiling(index):
  name, run, message = _refused_runs()[index]
  params = model.init_params(preset(name), jax.random.key(0))
  traced = dict(driver.TRACE_COUNTS)
  with pytest.raises(ValueError, match=message) as refused:
    run(params, prompts())
  assert "\n" not in str(refused.value)
  assert dict(driver.TRACE_COUNTS) == traced


@pytest.mark.parametrize("decoding, message", [
    ("dual_cache", "--policy=dkv_cache does not compose with --decoding=dual_cache"),
    ("threshold_prefix_cache", "--policy=dkv_cache does not compose with --decoding=threshold_prefix_cache"),
    ("wino", "--policy=dkv_cache does not run with --decoding=wino"),
])
def test_the_sessions_refuse_a_policy_with_a_cache_mode_or_wino(decoding, message):
  with pytest.raises(SessionError, match=message):
    decoding_mode.from_values(decoding, policy="dkv_cache")
  for allowed in ("exact", "threshold", "factor", "factor_dllm", "eb", "certainty_prior", "dual_cache",
                  "threshold_prefix_cache"):
    assert decoding_mode.from_values(allowed, policy="sparse_dllm").policy == "sparse_dllm"


# ---------------------------------------------------------------- dKV-Cache on Dream


def _dream_cached(decoded, shift_type, call):
  """The official Dream rule as read (NumPy): the positions a cached call reads from the cache."""
  if call == 1:
    return np.concatenate([decoded[1:], decoded[-1:]])
  if shift_type == "un":
    return np.concatenate([decoded[1:], decoded[:1]])
  pair = decoded[:-1] & decoded[1:]
  return np.concatenate([pair, pair[-1:]])


def dream_replay(prompt, plan, steps=8, gen=8):
  """Dream's `diffusion_generate` (alg maskgit_plus, temperature 0) for one row, every call through the NumPy Dream
  forward of tests/test_dream_modes.py: (tokens, decode_step, computed [steps, S]).

  plan(call, previous) -> None (a full call, which rewrites the cache) or (queries [T] ascending, kept): the call
  computes only those positions, every other position's keys and values read from the cache (each position's as
  its last computing call left them), each layer reading the cached keys kept[layer] only (kept None: all);
  previous: the previous call's input tokens [S]."""
  x = np.concatenate([prompt, np.full(gen, dream_ref.MASK)]).astype(np.int64)
  lp, total = len(prompt), len(prompt) + gen
  positions = np.arange(total)[None]
  decode_step, computed, cache, previous = np.full(gen, -1), [], None, None
  fractions = schedules.dream_transfer_fractions(steps, 1e-3)
  for call in range(steps):
    decision = plan(call, previous)
    if decision is None:
      logits, cache, _ = dream_ref.np_forward(x[None], positions, np.ones((1, total, total), bool),
                                              np.ones((1, total), bool))
      cache, queries = [list(kv) for kv in cache], np.arange(total)
    else:
      queries, kept = decision
      read = [np.arange(total) if kept is None else np.setdiff1d(kept[layer][kept[layer] < total], queries)
              for layer in range(dream_ref.CONFIG.n_layers)]
      width = max(len(r) for r in read) + (0 if kept is None else len(queries))
      allowed = np.ones((1, len(queries), width), bool)  # set per layer by keys_of: the forward reads it after

      def keys_of(layer, k, v, queries=queries, read=read, allowed=allowed):
        for index, fresh in enumerate((k, v)):
          cache[layer][index] = cache[layer][index].copy()
          cache[layer][index][:, queries] = fresh
        if kept is None:
          return cache[layer][0], cache[layer][1], positions
        pad = width - len(queries) - len(read[layer])
        at = np.concatenate([read[layer], np.zeros(pad, int), queries])
        allowed[:] = True
        allowed[:, :, len(read[layer]):len(read[layer]) + pad] = False
        return cache[layer][0][:, at], cache[layer][1][:, at], at[None]

      rows, _, _ = dream_ref.np_forward(x[None, queries], positions[:, queries], allowed,
                                        np.ones((1, len(queries)), bool), keys_of)
      logits = np.zeros((1, total, rows.shape[-1]))
      logits[0, queries] = rows[0]
    computed.append(np.isin(np.arange(total), queries))
    previous = x.copy()
    target = logits[0, lp - 1:total - 1]  # position p reads the output at p - 1
    masked = np.flatnonzero(x[lp:] == dream_ref.MASK)
    probs = np.exp(target[masked] - target[masked].max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    k = len(masked) if call == steps - 1 else int(np.floor(np.float32(len(masked)) * fractions[call]))
    order = sorted(range(len(masked)), key=lambda j: (-probs[j].max(), j))
    for j in order[:k]:
      x[lp + masked[j]] = probs[j].argmax()
      decode_step[masked[j]] = call
  return x, decode_step, np.array(computed)


DREAM_EXACT = dream.DreamOptions(gen_length=8, steps=8, alg="maskgit_plus")


@pytest.mark.parametrize("shift_type", ["un", "un_right"])
def test_dkv_cache_on_dream_is_the_replay_of_the_official_rule(shift_type):
  policy = parse_policy(f"dkv_cache:cache_reloading_step=3,shift_type={shift_type}")

  def plan(call, previous):
    if call % 3 == 0:
      return None
    return np.flatnonzero(~_dream_cached(previous != dream_ref.MASK, shift_type, call)), None

  for row, prompt in enumerate(dream_ref.prompts()):
    tokens, decode_step, computed = dream_replay(prompt, plan)
    trace = dream.diffusion_generate(dream_ref.params(), prompt[None], config=dream_ref.CONFIG, options=DREAM_EXACT,
                                     setup=RunSetup(policy=policy))
    np.testing.assert_array_equal(np.asarray(trace.tokens)[0], tokens, err_msg=f"{shift_type} row {row}")
    np.testing.assert_array_equal(np.asarray(trace.decode_step)[0], decode_step, err_msg=f"{shift_type} row {row}")
    np.testing.assert_array_equal(np.asarray(trace.computed_positions)[:, 0], computed)
    assert not computed.all()
    s, lp = computed.shape[-1], len(prompt)
    counted = policy.bind(RunLayout(s, lp, 8, 8, logit_shift=1))
    ran = np.asarray(trace.policy_record["rows"])[:, 0]
    for call in range(len(computed)):  # a cached call runs at the smallest bucket of its budget [lp − 1, S), 9 rows
      rows = s if call % 3 == 0 else min(b for b in (2, 3, 5, 9) if b >= computed[call].sum())
      assert ran[call] == rows, (row, call, ran)
      flops = counted.call_flops(dream_ref.CONFIG, computed[call], float(np.asarray(trace.keys_read)[call, 0]),
                                 {"rows": ran[call]})
      assert flops == ref.trunk_flops(dream_ref.CONFIG, rows, s), (row, call)  # the FLOPs the sweep counts


def test_sparse_dllm_on_dream_computes_the_position_before_the_block_and_is_the_replay():
  """Exact Dream (one block: the generation) under Sparse-dLLM: calls 0 and 1 full, later calls the block and the
  position before it over each layer's kept keys (the run's, `Trace.policy_record`: their rule is replayed on
  LLaDA above); tokens, decode order and computed positions against the NumPy replay."""
  policy = parse_policy(SPARSE)
  for row, prompt in enumerate(dream_ref.prompts()):
    trace = dream.diffusion_generate(dream_ref.params(), prompt[None], config=dream_ref.CONFIG, options=DREAM_EXACT,
                                     setup=RunSetup(policy=policy))
    record = np.asarray(trace.policy_record)[:, 0]  # [steps, L, n_keep]
    lp = len(prompt)
    plan = lambda call, previous: None if call <= 1 else (np.arange(lp - 1, lp + 8), record[call])  # noqa: E731
    tokens, decode_step, computed = dream_replay(prompt, plan)
    np.testing.assert_array_equal(np.asarray(trace.tokens)[0], tokens, err_msg=f"row {row}")
    np.testing.assert_array_equal(np.asarray(trace.decode_step)[0], decode_step, err_msg=f"row {row}")
    np.testing.assert_array_equal(np.asarray(trace.computed_positions)[:, 0], computed)
    assert np.all(record[2:] < lp) and not computed.all()
