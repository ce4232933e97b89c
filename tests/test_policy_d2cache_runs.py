"""d2cache as a runnable compute policy (issue 36): the "attention_rows" statistic against NumPy (dense, chunked
and fused alike), a whole LLaDA run at temperature 0 against a replay written here in the official code's order
(Kamichanw/d2Cache `src/generation/vanilla.py` `generate_step`, `src/cache/d2cache.py` `model_forward` /
`attention` / `accumulate_attn_rollout` / `on_step_end` / `top_up_mask`) over an independent float64 NumPy model
whose calls recompute the selected positions and read every other position's keys and values from when they
were last computed, rows alone as in their batch (batch-invariant: each row at its own query bucket, counted by a
callback), the query buckets' FLOPs, and the refusals."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

try:
  from tests.numpy_transformer import trunk_flops
  from tests.test_policy_d2cache import replay_query_mask, replay_rollout, replay_top_up
  from tests.test_policy_d2cache_loops import numpy_call
except ImportError:  # run from inside tests/
  from numpy_transformer import trunk_flops
  from test_policy_d2cache import replay_query_mask, replay_rollout, replay_top_up
  from test_policy_d2cache_loops import numpy_call

from dlm_jax.config import preset
from dlm_jax.core.attention_bias import MASK_VALUE
from dlm_jax.instrument.stats import StatsSpec
from dlm_jax.model import CallInstruments, Compute, KVCache, forward, init_params
from dlm_jax.model.attention import attention
from dlm_jax.model import query_buckets
from dlm_jax.model.compute_subset import ComputeSubset
from dlm_jax.policy import cost
from dlm_jax.policy.base import RunLayout
from dlm_jax.policy.registry import make_policy, parse_policy
from dlm_jax.sampling import dream, llada
from dlm_jax.sampling.run_setup import RunSetup

jax.config.update("jax_default_matmul_precision", "highest")

CONFIG = preset("tiny-llada")
PROMPT_LENGTH, GEN, BLOCK = 6, 16, 8
OPTIONS = llada.LLaDAOptions(gen_length=GEN, steps=GEN, block_length=BLOCK)
OFFICIAL = dict(current_k=4, inflate_w=2, rollout_p=0.2, query_buckets=3)
CLEAN = dict(OFFICIAL, frozen_confidence=False, top_up=False)


@pytest.fixture(scope="module")
def model():
  params = jax.jit(init_params, static_argnums=0)(CONFIG, jax.random.key(0))  # one program, not one per initialiser
  prompt = jax.random.randint(jax.random.key(1), (2, PROMPT_LENGTH), 3, 200)
  return params, prompt


def numpy_rows(q, k, scale, bias):
  """Head-mean softmax rows [B, T, S] of q [B, T, N, H], k [B, S, K, H] with an additive bias [B, N, T, S]."""
  group = q.shape[2] // k.shape[2]
  scores = np.einsum("btnh,bsnh->bnts", q, np.repeat(k, group, axis=2)) * scale + bias
  scores = np.maximum(scores, MASK_VALUE)
  probs = np.exp(scores - scores.max(-1, keepdims=True))
  return (probs / probs.sum(-1, keepdims=True)).mean(axis=1)


def test_attention_rows_are_the_head_mean_softmax_in_every_path():
  rng = np.random.default_rng(0)
  b, t, s, n, kv, h = 2, 7, 9, 4, 2, 8
  q, k, v = (rng.normal(size=shape).astype(np.float32) for shape in ((b, t, n, h), (b, s, kv, h), (b, s, kv, h)))
  key_bias = np.where(rng.random((b, 1, s)) < 0.3, MASK_VALUE, 0.0).astype(np.float32)
  pairwise = rng.normal(size=(b, n, t, s)).astype(np.float32)
  expected = numpy_rows(q.astype(np.float64), k.astype(np.float64), 0.3, pairwise + key_bias[:, :, None, :])
  for impl in ("dense", "chunked", "fused"):
    def both(*arrays, impl=impl):
      args = dict(scale=0.3, impl=impl, query_chunk=3, key_bias=arrays[3], pairwise_bias=arrays[4])
      return attention(*arrays[:3], with_rows=True, **args), attention(*arrays[:3], **args)[0]
    (out, incoming, rows), plain = jax.jit(both)(q, k, v, key_bias, pairwise)
    np.testing.assert_allclose(rows, expected, atol=2e-6, err_msg=impl)
    assert incoming is None
    np.testing.assert_array_equal(out, plain)


def test_a_subset_calls_rows_are_the_full_calls_rows_at_its_queries(model):
  params, prompt = model
  tokens = np.concatenate([prompt, np.full((2, GEN), CONFIG.mask_token_id, np.int32)], axis=1)
  run = jax.jit(functools.partial(forward, config=CONFIG, stats_spec=StatsSpec(extra=("attention_rows",))))
  full = run(params, tokens, cache=KVCache.zeros(CONFIG, 2, tokens.shape[1]))
  queries = np.asarray([[1, 7, 9, 21], [0, 2, 8, 22]], np.int32)  # 22 = S: padding
  part = run(params, np.take_along_axis(tokens, np.minimum(queries, 21), axis=1), cache=full.cache,
             subset=ComputeSubset(jnp.asarray(queries)))
  rows, whole = np.asarray(part.stats["attention_rows"]), np.asarray(full.stats["attention_rows"])
  assert whole.shape == (CONFIG.n_layers, 2, 22, 22) and rows.shape == (CONFIG.n_layers, 2, 4, 22)
  np.testing.assert_allclose(whole.sum(-1), 1.0, rtol=1e-5)
  for row in range(2):
    real = np.asarray(queries[row]) < 22
    np.testing.assert_allclose(rows[:, row, real], whole[:, row, np.asarray(queries[row])[real]], atol=1e-6)


def replay(params, prompt, settings):
  """The official d2Cache run with LLaDA's low-confidence sampler at temperature 0, in its order of operations:
  (tokens [B, S], decode step [B, G], NFE, computed positions per step [steps, B, S] bool)."""
  mask = CONFIG.mask_token_id
  prompt = np.asarray(prompt)
  b, p = prompt.shape
  x = np.concatenate([prompt, np.full((b, GEN), mask)], axis=1)
  s = p + GEN
  decode_step = np.full((b, GEN), -1)
  cache = conf = full_q = importance = density = None
  computed_per_step = []
  steps_per_block = OPTIONS.steps // (GEN // BLOCK)
  for step in range(OPTIONS.steps):
    block = step // steps_per_block
    block_mask = np.zeros((b, GEN), bool)
    block_mask[:, block * BLOCK:(block + 1) * BLOCK] = True
    remaining = x[:, p:] == mask
    if step % steps_per_block == 0:  # get_num_transfer_tokens over the block's masks
      counts = (remaining & block_mask).sum(-1)
      schedule = counts[:, None] // steps_per_block + (np.arange(steps_per_block)[None] < (
          counts % steps_per_block)[:, None])
    active = (remaining & block_mask).any(-1) & (schedule[:, step % steps_per_block] > 0)
    assert active.all(), "the replay covers runs whose every row generates at every step"
    if full_q is None:
      computed = np.ones((b, s), bool)
    else:  # model_forward: the top-up at this forward, then x[active_q_mask]
      computed = replay_top_up(full_q, importance, density, active) if settings["top_up"] else full_q.copy()
    computed_per_step.append(computed)
    logits, cache, rows = numpy_call(CONFIG, params, x, cache, computed)
    gen_logits = logits[:, p:]
    x0 = gen_logits.argmax(-1)
    probs = np.exp(gen_logits - gen_logits.max(-1, keepdims=True))
    confidence = np.where(remaining, (probs / probs.sum(-1, keepdims=True)).max(-1), -np.inf)
    transferred = np.zeros((b, GEN), bool)
    for row in range(b):  # top-k of the confidence among the block's masked positions
      candidates = np.where(remaining[row] & block_mask[row], confidence[row], -np.inf)
      order = np.argsort(-candidates, kind="stable")
      k = schedule[row, step % steps_per_block]
      assert candidates[order[k - 1]] > candidates[order[k]], "the replay covers tie-free transfers"
      transferred[row, order[:k]] = True
    assert not np.any(transferred & (x0 == mask)), "the replay covers runs that never transfer the mask id"
    new = x.copy()
    new[:, p:] = np.where(transferred, x0, x[:, p:])
    decode_step[transferred] = step
    # on_step_end
    if conf is None:
      conf = confidence
    elif not settings["frozen_confidence"]:
      valid = computed[:, p:] & remaining
      conf = np.where(valid, confidence, conf)
    importance = replay_rollout(rows, np.broadcast_to(np.arange(s), (b, s)), computed)
    full_q, density = replay_query_mask(make_policy("d2cache", **settings), new[:, p:] == mask, block_mask,
                                        transferred, conf, importance, False, active)
    x = new
  return x, decode_step, len(computed_per_step), np.stack(computed_per_step)


@pytest.fixture(scope="module")
def official_run(model):
  params, prompt = model
  return llada.generate(params, prompt, config=CONFIG, options=OPTIONS,
                        setup=RunSetup(policy=make_policy("d2cache", **OFFICIAL),
                                       stats_spec=StatsSpec(incoming_attention=True, per_head=False, query_groups=3)))


@pytest.fixture(scope="module")
def clean_run(model):
  """The clean settings' batch-invariant run and the query rows each row's forward ran at every subset call, in
  order (a callback in `query_buckets.pad_queries`, which each bucket's branch calls: it fires when it runs)."""
  params, prompt = model
  ran, pad = [], query_buckets.pad_queries

  def spy(output, n):
    size = (output.hidden if output.logits is None else output.logits).shape[1]
    jax.debug.callback(lambda: ran.append(size))
    return pad(output, n)

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(query_buckets, "pad_queries", spy)
    trace = llada.generate(params, prompt, config=CONFIG, options=OPTIONS,
                           setup=RunSetup(policy=make_policy("d2cache", **CLEAN), batch_invariant=True))
    jax.block_until_ready(trace)
  return trace, ran


@pytest.fixture(scope="module")
def clean_batch(clean_run):
  return clean_run[0]


@pytest.mark.parametrize("knobs, run", [(OFFICIAL, "official_run"), (CLEAN, "clean_batch")])
def test_a_run_is_the_official_codes_replay(model, knobs, run, request):
  params, prompt = model
  trace = request.getfixturevalue(run)
  settings = {name: getattr(make_policy("d2cache", **knobs), name)
              for name in ("current_k", "inflate_w", "rollout_p", "frozen_confidence", "top_up", "query_buckets")}
  tokens, decode_step, nfe, computed = replay(params, prompt, settings)
  np.testing.assert_array_equal(trace.computed_positions, computed)
  np.testing.assert_array_equal(trace.tokens, tokens)
  np.testing.assert_array_equal(trace.decode_step, decode_step)
  assert int(trace.nfe) == nfe == OPTIONS.steps
  assert computed[1:].sum(-1).max() < PROMPT_LENGTH + GEN  # the later steps skip positions
  np.testing.assert_array_equal(trace.policy_record["count"], computed.sum(-1))
  assert not np.any(trace.policy_record["overflow"])
  policy = make_policy("d2cache", **knobs).bind(RunLayout(22, PROMPT_LENGTH, BLOCK, BLOCK))
  assert policy.buckets == (6, 11, 22)
  ran = np.vectorize(lambda c: min(n for n in policy.buckets if n >= c))(computed.sum(-1))  # [steps, B]
  ran[0] = 22  # step 0 is full
  if run == "clean_batch":  # batch-invariant: each row runs at the bucket of its own count
    assert np.any(ran[:, 0] != ran[:, 1]) and ran.min() < 22
  else:  # batched: every row at the bucket of the batch's largest count
    ran = ran.max(-1, keepdims=True).repeat(2, 1)
  np.testing.assert_array_equal(trace.policy_record["rows"], ran)
  for step, row in np.ndindex(computed.shape[:2]):  # the FLOPs the sweep counts: the rows that ran, over S keys
    record = {name: np.asarray(x)[step, row] for name, x in trace.policy_record.items()}
    flops = policy.call_flops(CONFIG, computed[step, row], float(np.asarray(trace.keys_read)[step, row]), record)
    assert flops == trunk_flops(CONFIG, ran[step, row], 22), (step, row)
  other = dict(settings, frozen_confidence=not settings["frozen_confidence"])  # the flag decides something
  assert not np.array_equal(replay(params, prompt, other)[3], computed)


def test_the_users_statistics_sum_over_the_queries_each_step_computed(official_run):
  incoming = np.asarray(official_run.stats["incoming_attention"])  # [steps, L, B, 3 groups, S]
  computed = np.asarray(official_run.computed_positions)  # [steps, B, S]
  assert incoming.shape == (OPTIONS.steps, CONFIG.n_layers, 2, 3, PROMPT_LENGTH + GEN)
  np.testing.assert_allclose(incoming.sum((-2, -1)), np.broadcast_to(computed.sum(-1)[:, None], incoming.shape[:3]),
                             rtol=1e-5)
  assert "attention_rows" not in official_run.stats  # the policy's statistic is its own


def test_rows_decode_alone_as_in_their_batch_without_the_top_up(model, clean_batch):
  params, prompt = model
  for row in range(2):
    alone = llada.generate(params, prompt[row:row + 1], config=CONFIG, options=OPTIONS,
                           setup=RunSetup(batch_invariant=True, policy=make_policy("d2cache", **CLEAN)))
    np.testing.assert_array_equal(alone.tokens[0], clean_batch.tokens[row])
    np.testing.assert_array_equal(alone.decode_step[0], clean_batch.decode_step[row])
    np.testing.assert_array_equal(alone.computed_positions[:, 0], clean_batch.computed_positions[:, row])
    np.testing.assert_array_equal(alone.policy_record["rows"][:, 0], clean_batch.policy_record["rows"][:, row])


def test_each_row_ran_at_its_own_bucket(clean_run):
  """Batch-invariant: every subset call ran each row at its record's bucket (its own count's), not S."""
  trace, ran = clean_run
  rows = np.asarray(trace.policy_record["rows"])
  np.testing.assert_array_equal(ran, rows[1:].reshape(-1))  # step 0 is full; then row 0, row 1 at each step
  assert sum(ran) < 0.6 * rows[1:].size * rows[0, 0]


def test_a_small_bucket_computes_less_as_the_analytic_count_says(model):
  params, _ = model
  s = 64
  policy = make_policy("d2cache").bind(RunLayout(seq_len=s, gen_start=16, block_length=48, steps_per_block=48))
  assert policy.buckets == (8, 16, 32, 64)
  tokens = jnp.zeros((1, s), jnp.int32)
  cache = KVCache.zeros(CONFIG, 1, s)
  spec = policy.required_stats(CONFIG)

  def flops(n):
    def call(p, t, c):
      if n == s:
        return forward(p, t, config=CONFIG, compute=Compute(cache=c),
                       instruments=CallInstruments(stats_spec=spec)).logits
      queries = jnp.arange(n, dtype=jnp.int32)[None]
      return forward(p, t[:, :n], config=CONFIG, compute=Compute(cache=c, subset=ComputeSubset(queries)),
                     instruments=CallInstruments(stats_spec=spec)).logits
    return jax.jit(call).lower(params, tokens, cache).compile().cost_analysis()["flops"]

  full = flops(s)
  for n in policy.buckets[:2]:
    analytic = (cost.trunk_flops(CONFIG, n, s) + cost.head_flops(CONFIG, n)) / (
        cost.trunk_flops(CONFIG, s, s) + cost.head_flops(CONFIG, s))
    assert flops(n) < full * analytic * 1.3, n


@pytest.mark.parametrize("run, message", [
    (lambda p, x: parse_policy("d2cache:query_buckets=0"), "d2cache query_buckets must be an int >= 1, got 0"),
    (lambda p, x: parse_policy("d2cache:sigma=0"), "d2cache sigma must be a number > 0"),
    (lambda p, x: llada.generate(p, x, config=CONFIG, options=llada.LLaDAOptions(gen_length=8, steps=16,
                                                                                 block_length=8),
                                 policy=parse_policy("d2cache")), "needs every step to decode a token"),
    (lambda p, x: llada.generate(p, x, config=CONFIG, options=OPTIONS, policy=parse_policy("d2cache:query_budget=99")),
     "query_budget=99 is more than the sequence's 22 positions"),
    (lambda p, x: llada.generate(p, x, config=CONFIG, options=dataclasses.replace(OPTIONS, steps=8, threshold=0.9),
                                 policy=parse_policy("d2cache")),
     "policy d2cache with threshold or factor decoding runs the official loop, whose per-step quota .* needs steps "
     "per block == block_length 8, got 4 steps per block"),
    (lambda p, x: dream.diffusion_generate(p, x, config=preset("tiny-dream"), policy=parse_policy("d2cache")),
     "policy d2cache runs on Dream through Research dLLM's loop, as the official code: set decoding rule "
     "certainty_prior"),
])
def test_bad_knobs_and_runs_are_refused_in_one_line(model, run, message):
  params, prompt = model
  with pytest.raises(ValueError, match=message):
    run(params, prompt)
