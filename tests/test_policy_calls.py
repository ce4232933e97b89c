"""Compute policies applied by the model caller (issue 36 items 1, 3, 4): a decision that recomputes every
position gives the exact sampler's tokens, `Trace.computed_positions` is what the policy decided, the skipped
work leaves XLA's FLOP count, statistics stay in sequence coordinates, and runs a policy cannot take are
refused in one line before any compilation."""

import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlm_jax.analysis import policy_metrics
from dlm_jax.config import preset
from dlm_jax.instrument.hook_spec import Capture, Hooks
from dlm_jax.instrument.stats import StatsSpec
from dlm_jax.model import Compute, KVCache, forward, init_params
from dlm_jax.model.compute_subset import ComputeSubset
from dlm_jax.model.forward_inputs import CallInstruments, Readout
from dlm_jax.policy.base import ComputePolicy, Decision, RunLayout
from dlm_jax.policy.policies import DKVCacheState
from dlm_jax.policy.registry import parse_policy
from dlm_jax.sampling import autoregressive, dream, driver, llada
from dlm_jax.sampling.call_plan import PolicyState
from dlm_jax.sampling.policy_call import policy_forward
from dlm_jax.sampling.run_setup import RunSetup

try:
  from tests.numpy_transformer import trunk_flops
except ImportError:  # run from inside tests/
  from numpy_transformer import trunk_flops

jax.config.update("jax_default_matmul_precision", "highest")

CONFIG = preset("tiny-llada")
OPTIONS = llada.LLaDAOptions(gen_length=8, steps=8, block_length=4)
PROMPT = np.array([[196, 127, 40, 153, 168, 84], [38, 181, 106, 146, 8, 33]], np.int32)
"""`jax.random.randint(jax.random.key(1), (2, 6), 0, 200)`, written out: no random-number program to compile."""
SPARSE = "sparse_dllm:keep_ratio=0.5,tie_break=lowest_position"


@dataclasses.dataclass(frozen=True)
class Recent(ComputePolicy):
  """A test policy: full calls at the first two steps of a block and every `every` steps; otherwise the
  generated positions that were masked at the previous call (padded with S), or with `everything` every
  position."""

  NAME = "recent"
  every: int = 3
  everything: bool = False

  def init_state(self, config, batch):
    return jnp.ones((batch, self.layout.seq_len), bool)

  def decide(self, state, context):
    s, g0 = self.layout.seq_len, self.layout.gen_start
    index = jnp.arange(s)[None]
    if self.everything:
      return Decision(full=jnp.zeros((), bool), queries=jnp.broadcast_to(index, state.shape).astype(jnp.int32))
    want = state & (index >= g0)
    queries = jnp.sort(jnp.where(want, index, s), axis=1)[:, :s - g0].astype(jnp.int32)
    full = (context.step % self.layout.steps_per_block <= 1) | (context.step % self.every == 0)
    return Decision(full=full, queries=queries)

  def update(self, state, output, context, decision):
    return context.unresolved


@functools.lru_cache(maxsize=None)
def _params():
  return init_params(CONFIG, jax.random.key(0))


def _setup():
  return _params(), PROMPT


@functools.lru_cache(maxsize=None)
def _policy_run(text):
  """The exact sampler on PROMPT under `parse_policy(text)`, run once for the tests that read it."""
  return llada.generate(_params(), PROMPT, config=CONFIG, options=OPTIONS, setup=RunSetup(policy=parse_policy(text)))


def test_recomputing_everything_is_the_exact_sampler():
  params, prompt = _setup()
  spec = StatsSpec(incoming_attention=True, per_head=False)
  exact = llada.generate(params, prompt, config=CONFIG, options=OPTIONS, setup=RunSetup(stats_spec=spec))
  policy = llada.generate(params, prompt, config=CONFIG, options=OPTIONS,
                          setup=RunSetup(stats_spec=spec, policy=Recent(everything=True)))
  np.testing.assert_array_equal(policy.tokens, exact.tokens)
  np.testing.assert_array_equal(policy.decode_step, exact.decode_step)
  np.testing.assert_allclose(policy.stats["incoming_attention"], exact.stats["incoming_attention"], atol=2e-5)
  assert np.all(np.asarray(policy.computed_positions))


def test_computed_positions_are_the_decisions():
  params, prompt = _setup()
  trace = llada.generate(params, prompt, config=CONFIG, options=OPTIONS,
                         setup=RunSetup(policy=Recent(), stats_spec=StatsSpec(incoming_attention=True)))
  computed = np.asarray(trace.computed_positions)  # [steps, B, S]
  lp = prompt.shape[1]
  decoded_at = np.asarray(trace.decode_step)  # [B, G], the step whose call decoded each position
  for step in range(8):
    full = step == 0 or step % 4 <= 1 or step % 3 == 0
    masked_at_previous_call = np.concatenate([np.zeros((2, lp), bool), decoded_at >= step - 1], axis=1)
    expected = np.ones_like(masked_at_previous_call) if full else masked_at_previous_call
    np.testing.assert_array_equal(computed[step], expected, err_msg=f"step {step}")
  incoming = np.asarray(trace.stats["incoming_attention"])  # [steps, L, B, N, S]
  queries = computed.sum(-1)  # every computed query's row of probabilities sums to 1
  np.testing.assert_allclose(incoming.sum(-1), np.broadcast_to(queries[:, None, :, None], incoming.shape[:-1]),
                             rtol=1e-5)


def test_the_skipped_work_leaves_the_flop_count():
  params, _ = _setup()
  s, n = 64, 16
  tokens = jnp.zeros((1, s), jnp.int32)
  cache = KVCache.zeros(CONFIG, 1, s)

  def flops(fn, *args):
    return jax.jit(fn).lower(*args).compile().cost_analysis()["flops"]

  full = flops(lambda p, t, c: forward(p, t, config=CONFIG, compute=Compute(cache=c)).logits, params, tokens, cache)
  queries = jnp.arange(n, dtype=jnp.int32)[None]
  part = flops(lambda p, t, c: forward(p, t[:, :n], config=CONFIG,
                                      compute=Compute(cache=c, subset=ComputeSubset(queries))).logits,
               params, tokens, cache)
  assert part < full * (n / s) * 1.3, (part, full)


def test_a_dkv_cache_call_runs_at_its_bucket_and_computes_what_the_bucket_says():
  """One layer, S = 256, prompt 64 (budget 192; buckets 192, 96, 48, 24): with 160 or 10 positions masked at the
  previous call the policy's cached call runs at bucket 192 or 24. XLA's FLOP count of that call through the
  model caller's subset path (`policy_forward`, dense attention, hidden states read out; the decision's queries
  traced and cut to the bucket, as the caller's switch branch runs them; its full flag the constant False, so XLA
  keeps the subset branch of the call's `lax.cond`) falls with the bucket and lies within 10% above the test's
  count of the bucket's rows, which `call_flops` of the recorded rows equals."""
  config = dataclasses.replace(CONFIG, n_layers=1)
  params, _ = _setup()  # the first layer of the file's weights (layers stacked on axis 0): no init to compile
  params = {**params, "blocks": jax.tree.map(lambda a: np.asarray(a)[:1], params["blocks"])}
  s, lp = 256, 64
  policy = parse_policy("dkv_cache").bind(RunLayout(s, lp, 32, 32))
  tokens, cache = jnp.zeros((1, s), jnp.int32), KVCache.zeros(config, 1, s)

  def run(t, *, positions, instruments, readout, **compute):
    return forward(params, t, config=config, positions=positions, instruments=instruments, readout=readout,
                   compute=Compute(attention_impl="dense", **compute))

  counted = []
  for count, bucket in ((160, 192), (10, 24)):
    was_masked = np.zeros((1, s), bool)
    was_masked[0, s - count:] = True
    state = DKVCacheState(jnp.asarray(was_masked), jnp.full((1,), s, jnp.int32))
    decision = policy.decide(state, types.SimpleNamespace(block_step=2, step=2))
    assert not bool(decision.full) and int(decision.bucket_rows(s)[1]) == bucket, count
    call = lambda c, q, d=decision: policy_forward(  # noqa: E731
        run, PolicyState((), c), d.replace(queries=q, buckets=()), tokens, jnp.arange(s)[None], CallInstruments(),
        Readout(hidden=True)).hidden
    xla = jax.jit(call).lower(cache, decision.queries[:, :bucket]).compile().cost_analysis()["flops"]
    analytic = trunk_flops(config, bucket, s)
    assert policy.call_flops(config, was_masked[0], float(s), {"rows": bucket}) == analytic
    assert analytic <= xla < 1.1 * analytic, (count, xla, analytic)
    counted.append(xla)
  assert counted[0] > 4 * counted[1], counted


@pytest.mark.parametrize("run, message", [
    (lambda p, x: autoregressive.generate(p, x, config=preset("tiny-llama"), setup=RunSetup(policy=Recent())),
     "runs with the samplers whose every call reads the whole sequence"),
    (lambda p, x: llada.generate(p, x, config=CONFIG, options=OPTIONS,
                                 setup=RunSetup(policy=parse_policy("dkv_cache:shift_type=right"),
                                                hooks=Hooks(captures=(Capture("hook_resid_post"),)))),
     "dkv_cache cache_type and shift_type are the rules of Dream's code"),
    (lambda p, x: llada.generate(p, x, config=CONFIG, options=dataclasses.replace(OPTIONS, cfg_scale=1.0),
                                 setup=RunSetup(policy=Recent())), "classifier-free guidance"),
    (lambda p, x: llada.generate(p, x, config=CONFIG, options=dataclasses.replace(OPTIONS, cache="dual"),
                                 setup=RunSetup(policy=parse_policy("dllm_cache"))),
     "does not compose with cache='dual'"),
    (lambda p, x: dream.diffusion_generate(p, x, config=preset("tiny-dream"),
                                           options=dream.DreamOptions(gen_length=8, steps=8, block_length=4,
                                                                      alg="maskgit_plus", cache="prefix"),
                                           setup=RunSetup(policy=parse_policy("dkv_cache"))),
     "does not compose with cache='prefix'"),
])
def test_runs_a_policy_cannot_take_are_refused(run, message):
  params, prompt = _setup()
  traced = dict(driver.TRACE_COUNTS)
  with pytest.raises(ValueError, match=message) as refused:
    run(params, prompt)
  assert "\n" not in str(refused.value)
  assert dict(driver.TRACE_COUNTS) == traced  # refused before any sampler program was traced


def test_dkv_cache_and_sparse_dllm_compute_what_their_rules_say():
  params, prompt = _setup()
  lp = prompt.shape[1]
  dkv = llada.generate(params, prompt, config=CONFIG, options=OPTIONS,
                       setup=RunSetup(policy=parse_policy("dkv_cache:cache_reloading_step=3")))
  decoded_at = np.asarray(dkv.decode_step)
  s = lp + 8
  counted = parse_policy("dkv_cache:cache_reloading_step=3").bind(RunLayout(s, lp, 4, 4))
  ran, buckets = np.asarray(dkv.policy_record["rows"]), [8, 4, 2, 1]  # the budget G = 8 and its halves
  for step, computed in enumerate(np.asarray(dkv.computed_positions)):
    in_block = step % 4  # 8 steps over 2 blocks of 4
    rows = s
    if in_block <= 1 or in_block % 3 == 0:
      assert computed.all(), step
    else:  # the positions the previous call's input held [MASK] at, at the smallest bucket holding the batch's
      np.testing.assert_array_equal(computed[:, lp:], decoded_at >= step - 1, err_msg=f"step {step}")
      assert not computed[:, :lp].any()
      rows = min(b for b in buckets if b >= (decoded_at >= step - 1).sum(-1).max())
    np.testing.assert_array_equal(ran[step], rows, err_msg=f"step {step}")
    for row in range(2):  # the FLOPs the sweep counts: the bucket's rows, padding included
      flops = counted.call_flops(CONFIG, computed[row], float(np.asarray(dkv.keys_read)[step, row]),
                                 {"rows": ran[step, row]})
      assert flops == trunk_flops(CONFIG, rows, s), (step, row)
  assert sorted(set(ran.ravel()) - {s}) == [4, 8], ran  # step 2: 7 positions, step 6: 3 positions
  sparse = _policy_run(SPARSE)
  for step, computed in enumerate(np.asarray(sparse.computed_positions)):
    block = lp + (step // 4) * 4 + np.arange(4)
    expected = np.ones_like(computed) if step % 4 <= 1 else np.isin(np.arange(lp + 8), block)[None].repeat(2, 0)
    np.testing.assert_array_equal(computed, expected, err_msg=f"step {step}")


@pytest.mark.parametrize("text, message", [
    ("sparse_dllm:keep_ratio=0", r"sparse_dllm keep_ratio must be a number in \(0, 1\], got 0.0"),
    ("fast", "Unknown policy 'fast'; choose one of none, dkv_cache, sparse_dllm"),
    ("dkv_cache:reload=2", "policy dkv_cache has no knob 'reload'; its knobs: cache_reloading_step"),
    ("dkv_cache:cache_reloading_step=two", "is not of type int"),
    ("dkv_cache:cache_reloading_step", "is not knob=value"),
    ("dkv_cache:query_buckets=0", r"^dkv_cache query_buckets must be an int >= 1, got 0\.$"),
    ("none:x=1", "policy none has no knob 'x'"),
])
def test_policy_texts_are_checked_in_one_line(text, message):
  with pytest.raises(ValueError, match=message):
    parse_policy(text)


def test_a_row_decodes_alone_as_in_its_batch_under_a_policy():
  params, prompt = _setup()
  policy = parse_policy("dkv_cache:cache_reloading_step=3")
  keys = jax.random.split(jax.random.key(5), 2)
  both = llada.generate(params, prompt, config=CONFIG, options=OPTIONS, key=keys,
                        setup=RunSetup(policy=policy, batch_invariant=True))
  for row in range(2):
    alone = llada.generate(params, prompt[row:row + 1], config=CONFIG, options=OPTIONS, key=keys[row:row + 1],
                           setup=RunSetup(policy=policy, batch_invariant=True))
    np.testing.assert_array_equal(alone.tokens[0], both.tokens[row])
    np.testing.assert_array_equal(alone.computed_positions[:, 0], both.computed_positions[:, row])
    np.testing.assert_array_equal(alone.policy_record["rows"][:, 0], both.policy_record["rows"][:, row])


def test_keeping_the_sinks_adds_nothing_when_every_key_is_kept():
  params, prompt = _setup()
  spec = StatsSpec(incoming_attention=True)
  runs = [llada.generate(params, prompt, config=CONFIG, options=OPTIONS, setup=RunSetup(
              stats_spec=spec, policy=parse_policy(f"sparse_dllm:keep_ratio=1.0,tie_break=lowest_position{extra}")))
          for extra in ("", ",keep_sinks=3")]
  np.testing.assert_array_equal(runs[0].tokens, runs[1].tokens)
  np.testing.assert_allclose(runs[0].stats["incoming_attention"], runs[1].stats["incoming_attention"], atol=1e-6)
  with pytest.raises(ValueError, match="keep_sinks=99 is more than the 10 keys outside the block"):
    llada.generate(params, prompt, config=CONFIG, options=OPTIONS,
                   setup=RunSetup(policy=parse_policy("sparse_dllm:keep_sinks=99")))


def test_the_first_positions_are_kept_beside_the_scored_keys():
  """keep_first (the extra sink token's position 0): at each selection step every layer keeps positions
  0 .. keep_first − 1 besides the official scored keys, which are those of the official rule (the run of
  `test_dkv_cache_and_sparse_dllm_compute_what_their_rules_say`)."""
  runs = [_policy_run(SPARSE + extra) for extra in ("", ",keep_first=2")]
  n_keep = runs[0].policy_record.shape[-1]
  first = np.asarray(runs[1].policy_record[1])  # step 1: the first block's selection, same canvas in both runs
  scored = np.asarray(runs[0].policy_record[1])
  np.testing.assert_array_equal(first[..., :n_keep], scored)
  for row in first.reshape(-1, first.shape[-1]):
    assert {0, 1} <= set(row.tolist()), row
    held = row[row < PROMPT.shape[1] + 8].tolist()
    assert len(held) == len(set(held)), row  # a position the scores kept is not kept twice (its slot padded)
  assert any(not {0, 1} & set(row.tolist()) for row in scored.reshape(-1, n_keep)), "keep_first added nothing"
  with pytest.raises(ValueError, match="keep_first must be an integer >= 0"):
    parse_policy("sparse_dllm:keep_first=-1")


def test_dropped_attention_is_the_share_of_the_mass_outside_the_block_on_dropped_keys():
  rng = np.random.default_rng(0)
  steps, layers, s, block, per_block, width = 8, 2, 10, 2, 4, 4  # blocks at 4..5 and 6..7, selection steps 1, 5
  incoming = rng.random((steps, layers, 2, s))
  kept = np.full((steps, 2, layers, 3), s)
  kept[1, 1] = [[0, 2, s], [1, 8, 9]]
  kept[5, 1] = [[0, 1, 2], [3, 4, s]]
  got = policy_metrics.dropped_attention(incoming, kept, 1, width, block, per_block)
  expected = []
  for step, start in ((1, 4), (5, 6)):
    for layer in range(layers):
      outside = [j for j in range(s) if not start <= j < start + block]
      dropped = [j for j in outside if j not in kept[step, 1, layer]]
      expected.append(incoming[step, layer, 1, dropped].sum() / incoming[step, layer, 1, outside].sum())
  np.testing.assert_allclose(got, np.mean(expected))
  assert policy_metrics.dropped_attention(incoming, None, 1, width, block, per_block) is None
