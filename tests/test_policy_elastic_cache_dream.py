"""Elastic-Cache on Dream (issue 36): whole runs at temperature 0 against a float64 NumPy replay of the official
Dream loop's per-call computation (`_sample` in `dream/model/generation_utils_elastic.py` and
`DreamSdpaAttention.forward` in `dream/model/modeling_dream.py` of VILA-Lab/Elastic-Cache, read through its mirror
yxu-dev/Elastic-Cache), written here on a NumPy tiny Dream (q/k/v biases, grouped keys, AR-shifted logits): the
query set is the tracked tokens, the positions decoded at the previous call and the position before each of the
window's masked positions (their rows give its logits and the tracked-token statistic), the still-masked
positions zeroed in that statistic, per-layer input, query, key and value caches (keys and values after
`repeat_kv`), the drift test and the refresh from the layer after the first drifted one.

Decoding is the sampler's (the policy decides compute only): Dream's exact sampler (alg maskgit_plus: the
int(M̄·(1 − s/t)) most confident masked positions, its float32 fractions from `schedules.dream_transfer_fractions`,
tested bit for bit elsewhere), Fast-dLLM's Dream threshold decoding in blocks (the block-start call commits
the block's first position, later calls the block's most confident mask and every one >= 0.9), and the official
Dream decoding (`dream.elastic_cache_options`: threshold 0.9 over the sliding window, EOS truncation; `_sample`
with `get_transfer_index_fast`), replayed whole: tokens, decode order, NFE, query sets and refresh starts.
"""

import dataclasses

import jax
import numpy as np
import pytest

from dlm_jax.config import preset
from dlm_jax.model import init_params
from dlm_jax.policy.elastic_cache import ElasticCacheSettings
from dlm_jax.policy.registry import parse_policy
from dlm_jax.sampling import decoding_rules, dream
from dlm_jax.sampling.run_setup import RunSetup
from dlm_jax.sampling.schedules import dream_transfer_fractions

try:
  from tests import numpy_transformer as ref
  from tests.dream_window_replay import peaked_params, replay_window, softmax
except ImportError:  # run from inside tests/
  import numpy_transformer as ref
  from dream_window_replay import peaked_params, replay_window, softmax

jax.config.update("jax_default_matmul_precision", "highest")

CONFIG = dataclasses.replace(preset("tiny-dream"), n_layers=3)
LP, GAMMA, THRESHOLD = 6, 0.97, 0.9
EXACT = dream.DreamOptions(gen_length=12, steps=6, alg="maskgit_plus")
BLOCKS = dream.DreamOptions(gen_length=16, steps=16, block_length=4, threshold=THRESHOLD)
EOS = 69  # an id row 0 decodes while masks remain on both sides of it (row 1 never does): the EOS cut matters
WINDOW = dream.elastic_cache_options(gen_length=12, window=4)


@pytest.fixture(scope="module")
def setup():
  """The peaked tiny Dream weights (`dream_window_replay.peaked_params`: q/k/v biases, the LM head scaled by 8, so
  threshold calls decode several positions), and two prompts."""
  return peaked_params(CONFIG, init_params), jax.random.randint(jax.random.key(1), (2, LP), 3, 200)


def _run(setup, options, window):
  params, prompt = setup
  policy = parse_policy(f"elastic_cache:window_length={window},gamma={GAMMA}")
  return dream.diffusion_generate(params, prompt, config=CONFIG, options=options, setup=RunSetup(policy=policy))


@pytest.fixture(scope="module")
def exact_run(setup):
  return _run(setup, EXACT, EXACT.gen_length)


@pytest.fixture(scope="module")
def block_run(setup):
  return _run(setup, BLOCKS, BLOCKS.block_length)


@pytest.fixture(scope="module")
def window_run(setup):
  """The official decoding with the EOS id from the config."""
  params, prompt = setup
  policy = parse_policy(f"elastic_cache:window_length={WINDOW.window},gamma={GAMMA}")
  return dream.diffusion_generate(params, prompt, config=dataclasses.replace(CONFIG, eos_token_id=EOS),
                                  options=WINDOW, setup=RunSetup(policy=policy))


class OfficialDream:
  """The official Dream loop's model side for one row (module docstring): `call` runs one call and keeps the
  per-layer caches, the tracked tokens and the positions decoded at the previous call (`decoded`, set by the
  decoding)."""

  def __init__(self, params, margins):
    self.p = {name: np.asarray(v, np.float64) for name, v in ref._flat(params).items()}
    self.caches = {name: [None] * CONFIG.n_layers for name in ("x", "q", "k", "v")}
    self.track, self.decoded, self.calls, self.margins = np.zeros(0, int), np.zeros(0, int), 0, margins

  def _qkv(self, layer, x, rows):
    c, p = CONFIG, self.p
    h = ref._rms(x, p["blocks.attn_norm.weight"][layer], c.norm_eps)[None]
    q = ref._rope(ref._project(h, p, layer, "q").reshape(1, -1, c.n_heads, c.head_dim), rows, c.rope_theta)[0]
    k = ref._rope(ref._project(h, p, layer, "k").reshape(1, -1, c.n_kv_heads, c.head_dim), rows, c.rope_theta)[0]
    v = ref._project(h, p, layer, "v").reshape(-1, c.n_kv_heads, c.head_dim)
    group = c.n_heads // c.n_kv_heads
    return q, np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)

  def call(self, tokens, window_pos, pending):
    """tokens [S]; window_pos: the window's masked positions; pending: the still-masked set. -> (the window's
    logits [W, V] (rows window_pos − 1), the query positions as run (None for a full call), the first refreshed
    layer (0 for call 0, L for none))."""
    c, p, caches = CONFIG, self.p, self.caches
    s, n_layers, hd = len(tokens), c.n_layers, c.head_dim
    query_masked = window_pos - 1
    if self.calls == 0:
      query, start = np.arange(s), -1
    else:
      query, start = np.concatenate([self.track, self.decoded, query_masked]), n_layers
    x = p["embed.embedding"][tokens[query]]
    tracked = []
    for layer in range(n_layers):
      if layer > start:
        caches["x"][layer] = x.copy()
      else:
        caches["x"][layer][query] = x
        if layer == start:
          x = caches["x"][layer].copy()
      full = layer >= start
      rows = np.arange(s) if full else query
      q, k, v = self._qkv(layer, x, rows.astype(np.float64))
      if full:
        caches["q"][layer], caches["k"][layer], caches["v"][layer] = q, k, v
      else:
        past_k, past_q = caches["k"][layer].copy(), caches["q"][layer][self.track].copy()
        caches["k"][layer][query], caches["v"][layer][query], caches["q"][layer][query] = k, v, q
      probs = softmax(np.einsum("tnh,snh->nts", q, caches["k"][layer]) / np.sqrt(hd))  # [N, T, S]
      out = np.einsum("nts,snh->tnh", probs, caches["v"][layer]).reshape(len(x), -1) @ p["blocks.attn.o.kernel"][layer]
      if full:
        masked_rows = probs[:, query_masked]
      else:
        masked_rows = probs[:, len(query) - len(query_masked):]
        before = softmax(np.einsum("tnh,snh->nts", past_q, past_k) / np.sqrt(hd))
        now = probs[:, :len(self.track)]
        norms = np.linalg.norm(before, axis=0) * np.linalg.norm(now, axis=0)
        similarity = (np.sum(before * now, 0) / np.maximum(norms, 1e-8)).mean()
        self.margins.append(abs(similarity - GAMMA))
        if similarity < GAMMA:
          start = layer + 1
      score = masked_rows.sum(axis=(0, 1))
      score[pending] = 0.0
      tracked.append(np.argmax(score))
      x = x + out
      h = ref._rms(x, p["blocks.mlp_norm.weight"][layer], c.norm_eps)
      gate, up = h @ p["blocks.mlp.gate.kernel"][layer], h @ p["blocks.mlp.up.kernel"][layer]
      x = x + (gate / (1 + np.exp(-gate)) * up) @ p["blocks.mlp.down.kernel"][layer]
    logits = ref._rms(x, p["final_norm.weight"], c.norm_eps) @ p["lm_head.kernel"]
    logits = logits[query_masked] if len(x) == s else logits[len(query) - len(query_masked):]
    self.track = np.unique(tracked)
    first_call, self.calls = self.calls == 0, self.calls + 1
    return logits, None if first_call else query, 0 if first_call else start


def _replay_exact(params, prompt, margins):
  """Dream's exact sampler (alg maskgit_plus, temperature 0) under the official computation, window = the whole
  generation. -> (tokens [S], decode step [G], query sets per call (None: full), refresh start per call)."""
  gen, mask = EXACT.gen_length, CONFIG.mask_token_id
  tokens = np.concatenate([prompt, np.full(gen, mask)])
  model, decode_step, queries, starts = OfficialDream(params, margins), np.full(gen, -1), [], []
  fractions = dream_transfer_fractions(EXACT.steps, EXACT.eps)
  for step in range(EXACT.steps):
    pending = np.flatnonzero(tokens == mask)
    logits, query, start = model.call(tokens, pending, pending)
    queries.append(query)
    starts.append(start)
    probs = softmax(logits)
    confidence, x0 = probs.max(-1), probs.argmax(-1)
    count = len(pending) if step == EXACT.steps - 1 else int(np.floor(np.float32(len(pending)) * fractions[step]))
    order = np.argsort(-confidence, kind="stable")
    if 0 < count < len(pending):
      margins.append(confidence[order[count - 1]] - confidence[order[count]])
    chosen = order[:count]
    assert not np.any(x0[chosen] == mask), "the replay covers runs that never transfer the mask id"
    model.decoded = pending[chosen]
    tokens[model.decoded] = x0[chosen]
    decode_step[model.decoded - LP] = step
  return tokens, decode_step, queries, np.asarray(starts)


def _replay_blocks(params, prompt, margins):
  """Fast-dLLM's Dream threshold decoding in blocks under the official computation, window = the first B masks
  from the block's start. -> (tokens [S], decode step per generated position (the row's own call), query sets
  per call (None: full), refresh start per call)."""
  gen, block, mask = BLOCKS.gen_length, BLOCKS.block_length, CONFIG.mask_token_id
  tokens = np.concatenate([prompt, np.full(gen, mask)])
  model, decode_step, queries, starts = OfficialDream(params, margins), np.full(gen, -1), [], []
  for s in range(LP, LP + gen, block):
    for block_call in range(block):
      pending = np.flatnonzero(tokens == mask)
      if block_call and not np.any(pending < s + block):
        break
      window_pos = pending[pending >= s][:block]
      logits, query, start = model.call(tokens, window_pos, pending)
      queries.append(query)
      starts.append(start)
      probs = softmax(logits)
      confidence, x0 = probs.max(-1), probs.argmax(-1)
      if block_call == 0:  # the block-start call commits position s, whatever its confidence
        keep = window_pos == s
      else:
        candidate = (window_pos > s) & (window_pos < s + block)
        confidence = np.where(candidate, confidence, -np.inf)
        keep = candidate & ((confidence >= THRESHOLD) | (np.arange(len(window_pos)) == np.argmax(confidence)))
        margins.extend(np.abs(confidence[candidate] - THRESHOLD))
        if candidate.sum() > 1:
          margins.append(np.diff(np.sort(confidence[candidate])[-2:])[0])
      assert not np.any(x0[keep] == mask), "the replay covers runs that never decode the mask id"
      model.decoded = window_pos[keep]
      tokens[model.decoded] = x0[keep]
      decode_step[model.decoded - LP] = model.calls - 1
  return tokens, decode_step, queries, np.asarray(starts)


def _replay_window(params, prompt, margins, eos_id):
  """The official Dream loop with its own decoding (`dream_window_replay.replay_window`, temperature 0) under the
  official computation. -> (tokens [S], decode step per generated position [G] (-1: never), query sets per call
  (None: full), refresh start per call, whether the EOS cut left masks)."""
  model, queries, starts = OfficialDream(params, margins), [], []

  def call(tokens, window_pos, masked, decoded):
    model.decoded = decoded
    logits, query, start = model.call(tokens, window_pos, masked)
    queries.append(query)
    starts.append(start)
    return logits

  tokens, decode_step, _, cut = replay_window(call, prompt, WINDOW, CONFIG.mask_token_id, eos_id, margins)
  return tokens, decode_step, queries, np.asarray(starts), cut


def _check_calls(trace, row, own_calls, queries, starts):
  """The run's per-call decisions of `row` at its own calls own_calls [n] against the replay's."""
  s = trace.tokens.shape[1]
  np.testing.assert_array_equal(np.asarray(trace.policy_record["refresh_start"][own_calls, row]), starts)
  computed = np.asarray(trace.computed_positions[own_calls, row])
  assert computed[0].all()
  for call in range(1, len(own_calls)):
    recorded = np.asarray(trace.policy_record["queries"][own_calls[call], row])
    np.testing.assert_array_equal(recorded[recorded < s], np.unique(queries[call]), err_msg=f"call {call}")
    np.testing.assert_array_equal(np.flatnonzero(computed[call]), np.unique(queries[call]))


def test_the_exact_sampler_replays_the_official_computation(setup, exact_run):
  params, prompt = setup
  margins, seen, skipped_masks = [], [], 0
  for row in range(prompt.shape[0]):
    tokens, decode_step, queries, starts = _replay_exact(params, np.asarray(prompt[row]), margins)
    np.testing.assert_array_equal(np.asarray(exact_run.tokens[row]), tokens, err_msg=f"row {row}")
    np.testing.assert_array_equal(np.asarray(exact_run.decode_step[row]), decode_step, err_msg=f"row {row}")
    assert int(exact_run.nfe) == EXACT.steps
    _check_calls(exact_run, row, np.arange(EXACT.steps), queries, starts)
    seen.extend(starts[1:])
    masked = decode_step[None, :] >= np.arange(EXACT.steps)[:, None]  # [calls, G]: still masked at the call
    skipped_masks += int(np.sum(masked[1:] & ~np.asarray(exact_run.computed_positions[1:, row, LP:])))
  assert min(margins) > 1e-5, min(margins)  # no decision within float32's reach of flipping
  assert {1, 2, CONFIG.n_layers} <= set(seen), seen  # refreshes from several layers, and calls without one
  assert skipped_masks, "masks whose own row is not computed (the row before gives their logits)"


def test_threshold_decoding_in_blocks_replays_the_official_computation(setup, block_run):
  params, prompt = setup
  margins, seen, parallel = [], [], 0
  for row in range(prompt.shape[0]):
    tokens, decode_step, queries, starts = _replay_blocks(params, np.asarray(prompt[row]), margins)
    active = np.asarray(block_run.active_rows[:int(block_run.nfe), row])  # waits while the other row ends a block
    own_calls = np.flatnonzero(active)
    np.testing.assert_array_equal(np.asarray(block_run.tokens[row]), tokens, err_msg=f"row {row}")
    own_step = (np.cumsum(active) - 1)[np.asarray(block_run.decode_step[row])]
    np.testing.assert_array_equal(own_step, decode_step, err_msg=f"row {row}")
    assert int(block_run.row_nfe[row]) == len(starts)
    _check_calls(block_run, row, own_calls, queries, starts)
    seen.extend(starts[1:])
    parallel += int(np.max(np.bincount(decode_step)) > 1)
  assert min(margins) > 1e-5, min(margins)
  assert parallel and {1, CONFIG.n_layers} <= set(seen), (parallel, seen)


def test_the_official_dream_decoding_replays_the_official_loop(setup, window_run):
  """`dream.elastic_cache_options` (threshold 0.9 over a sliding window of 4, EOS truncation, no blocks) with the
  policy of the same window: each row's tokens (masks left after the EOS cut), decode order, NFE, query sets and
  refresh starts are the official loop's, in a batch whose rows finish at different calls."""
  params, prompt = setup
  margins, seen, nfes, cuts, parallel = [], [], [], [], 0
  for row in range(prompt.shape[0]):
    tokens, decode_step, queries, starts, cut = _replay_window(params, np.asarray(prompt[row]), margins, EOS)
    active = np.asarray(window_run.active_rows[:int(window_run.nfe), row])
    own_calls = np.flatnonzero(active)
    np.testing.assert_array_equal(np.asarray(window_run.tokens[row]), tokens, err_msg=f"row {row}")
    np.testing.assert_array_equal(np.asarray(window_run.decode_step[row]), decode_step, err_msg=f"row {row}")
    np.testing.assert_array_equal(own_calls, np.arange(len(starts)))  # active from its first call to its last
    assert int(window_run.row_nfe[row]) == len(starts)
    _check_calls(window_run, row, own_calls, queries, starts)
    seen.extend(starts[1:])
    nfes.append(len(starts))
    cuts.append(cut)
    parallel += int(np.max(np.bincount(decode_step[decode_step >= 0])) > 1)
  assert min(margins) > 1e-5, min(margins)  # no threshold or drift decision within float32's reach of flipping
  assert cuts == [True, False] and nfes[0] != nfes[1] and parallel, (cuts, nfes, parallel)
  assert np.sum(np.asarray(window_run.tokens[0, LP:]) == CONFIG.mask_token_id) > 0  # the cut left masks
  assert {1, 2, CONFIG.n_layers} <= set(seen), seen
  assert int(window_run.nfe) == max(nfes)


def test_published_dream_settings_are_the_scripts():
  """`dream/eval_gsm8k.sh`: window 32, gamma 0.9; `dream/eval_humaneval.sh`: window 16, gamma 0.98; both threshold
  0.9, track_num 1, block caching."""
  gsm8k, humaneval = ElasticCacheSettings.published("dream", "gsm8k"), ElasticCacheSettings.published("dream",
                                                                                                        "humaneval")
  assert (gsm8k.window_length, gsm8k.gamma, humaneval.window_length, humaneval.gamma) == (32, 0.9, 16, 0.98)
  assert {s.threshold for s in (gsm8k, humaneval)} == {0.9} and {s.track_num for s in (gsm8k, humaneval)} == {1}
  assert gsm8k.block_caching and humaneval.block_caching


@pytest.mark.parametrize("options, message", [
    (dream.DreamOptions(gen_length=8, steps=8, block_length=4, threshold=0.9, cache="prefix"),
     "does not compose with cache='prefix'"),
    (dream.DreamOptions(gen_length=8, steps=8, rule=decoding_rules.EBSampler()), "not dream_rules"),
    (dream.DreamOptions(gen_length=8, steps=8, block_length=4, threshold=0.9),
     "window_length=2 is shorter than the sampler's block_length=4"),
    (dream.elastic_cache_options(gen_length=8, window=4), "window_length=2 is shorter than the sampler's decoding "
                                                          "window=4"),
])
def test_dream_runs_it_cannot_take_are_refused_in_one_line(setup, options, message):
  params, prompt = setup
  with pytest.raises(ValueError, match=message) as refused:
    dream.diffusion_generate(params, prompt, config=CONFIG, options=options,
                             setup=RunSetup(policy=parse_policy("elastic_cache:window_length=2")))
  assert "\n" not in str(refused.value)


@pytest.mark.parametrize("options, message", [
    (dict(window=4), "window and eos_truncation .Elastic-Cache's Dream decoding. run with threshold or factor"),
    (dict(threshold=0.9, window=4, block_length=4), "no blocks, cache='none' and no rule; got threshold=0.9, "
                                                     "factor=None, block_length=4"),
    (dict(threshold=0.9, eos_truncation=True, alg="entropy"), "leave alg at 'origin' or use 'maskgit_plus'"),
    (dict(threshold=0.9, window=0), "window must be a positive integer or None, got 0"),
    (dict(threshold=0.9), "set block_length .block_length=gen_length for one block., or window / eos_truncation"),
    (dict(threshold=0.9, window=4, eos_token_id=7), "eos_token_id .7. is the EOS id of eos_truncation"),
])
def test_bad_window_options_are_refused_in_one_line(options, message):
  with pytest.raises(ValueError, match=message) as refused:
    dream.DreamOptions(gen_length=8, steps=8, **options)
  assert "\n" not in str(refused.value)
