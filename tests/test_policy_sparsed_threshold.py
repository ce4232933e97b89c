"""SparseD with threshold decoding (issue 36 item 3: the blockwise sampler without a cache) and the extra sink
token's block (keep_first): whole runs against a replay written here (a Python loop over the NumPy forward with a
dense token mask per layer of tests/test_policy_sparsed_runs.py, the official step-E rule in NumPy, counted in the
row's own model calls, block 0 OR-ed in), each row in its batch as alone in the batch-invariant mode (the rows
wait for each other and reach their step E at different calls), the sink token's bundle keeping block 0, and the
knob refused when out of range."""

import functools
import types

import jax
import numpy as np
import pytest

from dlm_jax.config import preset
from dlm_jax.instrument.stats import StatsSpec
from dlm_jax.model import init_params
from dlm_jax.policy.registry import parse_policy
from dlm_jax.sampling import llada
from experiments.common import decoding
from dlm_jax.sampling.run_setup import RunSetup

try:
  from tests import test_policy_sparsed_runs as sparsed_ref
  from tests.threshold_replay import threshold_commits
except ImportError:  # run from inside tests/
  import test_policy_sparsed_runs as sparsed_ref
  from threshold_replay import threshold_commits

jax.config.update("jax_default_matmul_precision", "highest")

CONFIG = preset("tiny-llada")
MASK = CONFIG.mask_token_id
LP, GEN, STEPS, BLOCK, TAU = 6, 8, 8, 4, 0.9  # S = 14: key blocks of 3 leave a partial last block
END = int(STEPS * 0.2) + 1  # E: the row's own call that chooses the blocks
POLICY = "sparsed:skip=0.2,select=0.3,block_size=3,keep_first=1"


@functools.lru_cache(maxsize=None)
def peaked_params():
  """Random weights with a scaled LM head: some proposals are confident, so blocks take a variable number of calls."""
  params = init_params(CONFIG, jax.random.key(3))
  params["lm_head"]["kernel"] = params["lm_head"]["kernel"] * 6.0
  return params


def prompts():
  """Row 0 decodes its first block in 2 calls, row 1 in 4: in their batch row 0 waits 2 calls before its step E."""
  return np.random.default_rng(6).integers(3, 200, size=(2, LP)).astype(np.int32)


@functools.lru_cache(maxsize=None)
def generate(rows):
  """The batch-invariant run of prompts()[rows] (with the incoming attention): the replay test's runs alone are the
  batch test's references."""
  options = llada.LLaDAOptions(gen_length=GEN, steps=STEPS, block_length=BLOCK, threshold=TAU)
  setup = RunSetup(policy=parse_policy(POLICY), batch_invariant=True, stats_spec=StatsSpec(incoming_attention=True))
  return llada.generate(peaked_params(), prompts()[list(rows)], config=CONFIG, options=options, setup=setup)


def replay(prompt, margins):
  """One row of Fast-dLLM threshold decoding (τ = TAU, blocks of BLOCK, no cache) under SparseD (skip 0.2, select
  0.3, block_size 3, block 0 always kept): (tokens [S], decode_step [G], nfe, the chosen blocks
  [L, 1, N, nQb, nKb], how many (layer, head, query block) the official rule left without block 0).
  Calls 0 .. E are dense; call E's q and k choose the blocks (the official rule) and block 0 is OR-ed in; later
  calls attend through that mask. `margins` collects |confidence − τ| and the gap between the two most
  confident."""
  x = np.concatenate([prompt, np.full(GEN, MASK)])[None].astype(np.int64)
  s = x.shape[1]
  decode_step, masks, fine, nfe, added = np.full(GEN, -1), None, None, 0, 0
  for start in range(LP, s, BLOCK):
    step = 0
    while step < BLOCK and np.any(x[0, start:start + BLOCK] == MASK):
      logits, qk = sparsed_ref._np_forward(peaked_params(), x, CONFIG, masks)
      if nfe == END:
        fine = [sparsed_ref._official_blocks(q, k, 3, 0.3, GEN, CONFIG.n_heads) for q, k in qk]
        added = sum(int(np.sum(~layer_blocks[..., 0])) for layer_blocks in fine)
        for layer_blocks in fine:
          layer_blocks[..., 0] = True
        masks = [sparsed_ref._token_mask(f, s, 3) for f in fine]
      candidates = np.flatnonzero(x[0, start:start + BLOCK] == MASK) + start
      chosen, x0 = threshold_commits(logits[0, candidates], TAU, margins)
      for j in chosen:
        x[0, candidates[j]] = x0[j]
        decode_step[candidates[j] - LP] = nfe
      nfe += 1
      step += 1
  return x[0], decode_step, nfe, np.stack(fine), added


def test_threshold_decoding_under_sparsed_with_the_sink_block_is_the_replay():
  margins, lengths, sparse_calls, sink_added = [], set(), 0, 0
  for row, prompt in enumerate(prompts()):
    tokens, decode_step, nfe, fine, added = replay(prompt, margins)
    sink_added += added
    trace = generate((row,))
    np.testing.assert_array_equal(np.asarray(trace.tokens)[0], tokens, err_msg=f"row {row}")
    np.testing.assert_array_equal(np.asarray(trace.decode_step)[0], decode_step, err_msg=f"row {row}")
    assert int(trace.nfe) == nfe
    record = np.asarray(trace.policy_record)[:nfe]  # [calls, 1, L, N, nQb, m]
    n_blocks = fine.shape[-1]
    for call in range(nfe):
      kept = np.zeros(record.shape[1:-1] + (n_blocks + 1,), bool)
      np.put_along_axis(kept, record[call], True, axis=-1)
      expected = np.zeros_like(kept[..., :-1]) if call < END else np.moveaxis(fine, 0, 1)
      np.testing.assert_array_equal(kept[..., :-1], expected, err_msg=f"row {row} call {call}")
    keys = np.asarray(trace.keys_read)[:nfe, 0]
    np.testing.assert_array_equal(keys[:END + 1], LP + GEN)
    assert np.all(keys[END + 1:] < LP + GEN)
    sparse_calls += nfe - END - 1
    lengths |= {int(decode_step[:BLOCK].max() - decode_step[:BLOCK].min() + 1),
                int(decode_step[BLOCK:].max() - decode_step[BLOCK:].min() + 1)}
  assert min(margins) > 1e-4, "a decision of the replay is within rounding of flipping: change the case"
  assert len(lengths) > 1, f"block lengths {lengths}: variable blocks not exercised"
  assert sparse_calls > 0, "no call attended through the mask"
  assert sink_added > 0, "the official rule kept block 0 everywhere: keep_first not exercised"


def test_a_row_decodes_alone_as_in_its_batch_whose_rows_wait():
  """Batch-invariant: each row's calls in the batch (those it decoded for) are bitwise its calls alone — tokens,
  decode order, NFE, incoming attention, kept blocks, keys read — although the rows reach step E at different
  calls of the batch (a per-batch dense call would give row 1 dense calls after its E)."""
  both = generate((0, 1))
  active = np.asarray(both.active_rows)[:int(both.nfe)]  # [calls, B]
  at_end = [int(np.flatnonzero(active[:, row])[END]) for row in range(2)]
  assert at_end[0] != at_end[1], f"both rows reach step E at batch call {at_end[0]}: no row waits before E"
  for row in range(2):
    alone, calls = generate((row,)), np.flatnonzero(active[:, row])
    nfe = int(alone.nfe)
    assert len(calls) == nfe, f"row {row}"
    np.testing.assert_array_equal(np.asarray(alone.tokens)[0], np.asarray(both.tokens)[row])
    np.testing.assert_array_equal(calls[np.asarray(alone.decode_step)[0]], np.asarray(both.decode_step)[row])
    pairs = [(alone.stats["incoming_attention"], both.stats["incoming_attention"], 2),
             (alone.policy_record, both.policy_record, 1), (alone.keys_read, both.keys_read, 1)]
    for name, (one, batch, axis) in zip(("incoming_attention", "policy_record", "keys_read"), pairs):
      np.testing.assert_array_equal(np.take(np.asarray(one)[:nfe], 0, axis=axis),
                                    np.take(np.asarray(batch)[calls], row, axis=axis), err_msg=f"row {row} {name}")


def test_a_model_with_the_sink_token_keeps_its_block():
  with_token, without = types.SimpleNamespace(sink_token="front"), types.SimpleNamespace(sink_token="none")
  policy = parse_policy("sparsed:select=0.3")
  assert policy.keep_first == 0  # the official rule keeps no block by rule
  assert decoding.sink_token_kept(with_token, policy).keep_first == 1
  assert decoding.sink_token_kept(without, policy) == policy


@pytest.mark.parametrize("text, message", [
    ("sparsed:keep_first=-1", "sparsed keep_first must be an integer >= 0, got -1"),
    ("sparsed:keep_first=true", "keep_first"),
])
def test_keep_first_out_of_range_is_refused_in_one_line(text, message):
  with pytest.raises(ValueError, match=message) as error:
    parse_policy(text)
  assert "\n" not in str(error.value)
