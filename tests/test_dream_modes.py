"""Dream's block-by-block modes (Fast-dLLM's Dream code, decoding_modes.md §7): token- and step-identical at
temperature 0 to a step-by-step NumPy re-implementation written here — its own float64 forward of the tiny
Qwen2-style model, its own caches (every layer's keys and values before RoPE from the refresh forward;
the prefix truncated to [0, s) and concatenated with each call's fresh keys, the dual cache written in
place at the block) — plus loops, padding, waiting rows, statistics and errors."""

import functools

import jax
import numpy as np
import pytest
import torch

from dlm_jax import model
from dlm_jax.config import preset
from dlm_jax.instrument.interventions import MaskPreviousSinks
from dlm_jax.sampling import dream, model_call
from dlm_jax.instrument.stats import StatsSpec
from dlm_jax.sampling.run_setup import RunSetup

jax.config.update("jax_default_matmul_precision", "highest")

CONFIG = preset("tiny-dream")
MASK, PAD = CONFIG.mask_token_id, CONFIG.pad_token_id
HEAD_SCALE = 6.0  # LM head scale: peaked predictions, so float32 and float64 agree on every decision
MARGIN = 1e-4     # smallest gap the reference may meet at a decision (argmax, threshold, ranking)


@functools.lru_cache(maxsize=None)
def params():
  p = model.init_params(CONFIG, jax.random.key(3))
  p["lm_head"]["kernel"] = p["lm_head"]["kernel"] * HEAD_SCALE
  return p


def prompts(batch=2, length=5, seed=0):
  return np.random.default_rng(seed).integers(3, 200, size=(batch, length)).astype(np.int32)


# ---------------------------------------------------------------------------------------------------------
# The NumPy reference: a float64 forward of the tiny Qwen2-style Dream model and Fast-dLLM's Dream loop.


@functools.lru_cache(maxsize=None)
def weights():
  return {name: np.asarray(value, np.float64) for name, value in model.flatten_params(params()).items()}


def _rms(x, weight):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + CONFIG.norm_eps) * weight


def _rope(x, positions):
  """Rotate-half RoPE of x [B, T, n, H] at positions [B, T]."""
  h = x.shape[-1]
  inv_freq = 1.0 / CONFIG.rope_theta ** (np.arange(0, h, 2) / h)
  angles = positions[..., None].astype(np.float64) * inv_freq
  angles = np.concatenate([angles, angles], axis=-1)[:, :, None, :]
  rotated = np.concatenate([-x[..., h // 2:], x[..., :h // 2]], axis=-1)
  return x * np.cos(angles) + rotated * np.sin(angles)


def _softmax(x, axis=-1):
  e = np.exp(x - np.max(x, axis=axis, keepdims=True))
  return e / e.sum(axis, keepdims=True)


def np_forward(tokens, positions, allowed, query_valid, keys_of=None):
  """Runs the model on tokens [B, T] at RoPE positions [B, T]; allowed [B, T, S] bool (query sees key);
  query_valid [B, T] bool, the real queries (the ones the statistics sum over).

  keys_of(layer, k, v) -> (keys, values, key_positions): the S keys and values of a layer before RoPE
  ([B, S, K, H]) given the call's own k, v [B, T, K, H]; default: the call's own (S = T).
  Returns (logits [B, T, V], [(k, v)] per layer before RoPE, incoming [L, B, S] attention summed over
  the real queries, mean over heads)."""
  w, c = weights(), CONFIG
  b, t = tokens.shape
  x = w["embed.embedding"][tokens]
  kv, incoming = [], []
  for layer in range(c.n_layers):
    p = {name[len("blocks."):]: value[layer] for name, value in w.items() if name.startswith("blocks.")}
    h = _rms(x, p["attn_norm.weight"])
    q = (h @ p["attn.q.kernel"] + p["attn.q.bias"]).reshape(b, t, c.n_heads, c.head_dim)
    k = (h @ p["attn.k.kernel"] + p["attn.k.bias"]).reshape(b, t, c.n_kv_heads, c.head_dim)
    v = (h @ p["attn.v.kernel"] + p["attn.v.bias"]).reshape(b, t, c.n_kv_heads, c.head_dim)
    kv.append((k, v))
    keys, values, key_positions = (k, v, positions) if keys_of is None else keys_of(layer, k, v)
    group = c.n_heads // c.n_kv_heads
    keys = np.repeat(_rope(keys, key_positions), group, axis=2)
    values = np.repeat(values, group, axis=2)
    scores = np.einsum("btnh,bsnh->bnts", _rope(q, positions), keys) / np.sqrt(c.head_dim)
    probs = _softmax(np.where(allowed[:, None], scores, -1e30))
    incoming.append((probs * query_valid[:, None, :, None]).sum(axis=2).mean(axis=1))
    out = np.einsum("bnts,bsnh->btnh", probs, values).reshape(b, t, -1)
    x = x + out @ p["attn.o.kernel"]
    h = _rms(x, p["mlp_norm.weight"])
    gate = h @ p["mlp.gate.kernel"]
    x = x + (gate / (1.0 + np.exp(-gate)) * (h @ p["mlp.up.kernel"])) @ p["mlp.down.kernel"]
  logits = _rms(x, w["final_norm.weight"]) @ w["lm_head.kernel"]
  return logits, kv, np.stack(incoming)


def _shift(logits):
  """Dream's shift inside a window: row p reads the output at p − 1, the first row its own."""
  return np.concatenate([logits[:, :1], logits[:, :-1]], axis=1)


class Reference:
  """Fast-dLLM's Dream block loop (decoding_modes.md §7) at temperature 0, batched in lockstep: every row
  runs each call; a row with no mask left in the block is unchanged until the batch moves on. The
  confidence is p(x0), or the negative entropy with alg="entropy" (what Fast-dLLM's quota always uses)."""

  def __init__(self, prompt, prompt_mask, gen_length, block_length, cache, threshold=None, factor=None, steps=None,
               alg="maskgit_plus", eps=1e-3):
    assert block_length >= 2  # the reference tests completion after its cached calls; equal to before when B >= 2
    b, lp = prompt.shape
    self.lp, self.block, self.cache, self.alg = lp, block_length, cache, alg
    self.threshold, self.factor = threshold, factor
    self.x = np.concatenate([prompt, np.full((b, gen_length), MASK)], axis=1).astype(np.int64)
    total = lp + gen_length
    valid = np.ones((b, total), bool)
    if prompt_mask is not None:
      valid[:, :lp] = prompt_mask.astype(bool)
    self.query_valid = valid
    self.positions = np.where(valid, np.cumsum(valid, axis=1) - 1, 1)
    self.allowed = valid[:, :, None] & valid[:, None, :]
    self.decode_step = np.full((b, gen_length), -1)
    self.nfe, self.active, self.queries, self.incoming, self.transfers, self.margins = 0, [], [], [], [], []
    self.steps_per_block = None if steps is None else steps // (gen_length // block_length)
    self.timesteps = None if steps is None else torch.linspace(1, eps, self.steps_per_block + 1)
    for start in range(lp, total, block_length):
      self._block(start, start + block_length)

  def _record(self, before, queries, incoming):
    changed = (before[:, self.lp:] == MASK) & (self.x[:, self.lp:] != MASK)
    self.decode_step[changed] = self.nfe
    self.queries.append(queries)
    self.incoming.append(incoming)
    self.nfe += 1

  def _proposal(self, logits):
    """x0, p(x0) (or the negative entropy) of logits [V]; records the top1 − top2 logit gap."""
    top = np.sort(logits)[-2:]
    self.margins.append(top[1] - top[0])
    probs = _softmax(logits)
    confidence = np.sum(probs * np.log(probs + 1e-10)) if self.alg == "entropy" else probs.max()
    return int(np.argmax(logits)), confidence

  def _block(self, s, e):
    x = self.x
    logits, kv, incoming = np_forward(x, self.positions, self.allowed, self.query_valid)
    before = x.copy()
    for row in range(x.shape[0]):
      x[row, s], _ = self._proposal(_shift(logits)[row, s])
    self.active.append(np.ones(x.shape[0], bool))
    self._record(before, (0, x.shape[1]), incoming)
    cached = [(k.copy(), v.copy()) for k, v in kv]
    step_in_block = 1
    while np.any(x[:, s:e] == MASK):
      assert np.all(x[:, s] != MASK)
      if self.cache == "none":
        start, stop, keys_of = 0, x.shape[1], None
      elif self.cache == "prefix":
        start, stop = s, x.shape[1]
        def keys_of(layer, k, v):
          return (np.concatenate([cached[layer][0][:, :s], k], axis=1),
                  np.concatenate([cached[layer][1][:, :s], v], axis=1), self.positions)
      else:
        start, stop = s, e
        def keys_of(layer, k, v):
          cached[layer][0][:, s:e], cached[layer][1][:, s:e] = k, v
          return cached[layer][0], cached[layer][1], self.positions
      logits, _, incoming = np_forward(x[:, start:stop], self.positions[:, start:stop],
                                       self.allowed[:, start:stop], self.query_valid[:, start:stop], keys_of)
      logits = _shift(logits)[:, s - start:e - start]
      before = x.copy()
      self.active.append(np.any(x[:, s:e] == MASK, axis=1))
      mean_masks = torch.tensor(int(np.sum(x[:, s:e] == MASK))) / x.shape[0]  # the quota's n: a batch mean
      for row in range(x.shape[0]):
        self._transfer(row, s, logits[row], step_in_block, mean_masks)
      self.transfers.append(np.sum((before == MASK) & (x != MASK), axis=1))
      self._record(before, (start, stop), incoming)
      step_in_block += 1

  def _transfer(self, row, s, logits, step_in_block, mean_masks):
    """One row's transfer in block [s, s + block) from the block's logits [block, V]; mean_masks: the
    batch's masks in the block / batch size (a float32 tensor, as Fast-dLLM's quota uses)."""
    masked = np.flatnonzero(self.x[row, s:s + self.block] == MASK)
    if not len(masked):
      return
    proposals = [self._proposal(logits[p]) for p in masked]
    confidence = np.array([c for _, c in proposals])
    order = np.argsort(-confidence, kind="stable")
    ranked = confidence[order]
    if self.factor is not None:  # the longest prefix of ranks r with c_(r) >= 1 - f / (r + 1), rank 1 always
      bound = np.concatenate([[-np.inf], 1.0 - self.factor / (np.arange(2, len(ranked) + 1) + 1.0)])
      count = int(np.sum(np.cumprod(ranked >= bound)))
      keep = np.arange(len(ranked)) < count
      self.margins.extend(np.abs(ranked[1:] - bound[1:]))
      if count < len(ranked):
        self.margins.append(ranked[count - 1] - ranked[count])
    elif self.threshold is not None:
      keep = np.concatenate([[True], ranked[1:] >= self.threshold])
      self.margins.extend(np.abs(ranked[1:] - self.threshold))
      if len(ranked) > 1 and ranked[1] < self.threshold:
        self.margins.append(ranked[0] - ranked[1])
    else:
      t, t_next = self.timesteps[step_in_block], self.timesteps[step_in_block + 1]
      last = step_in_block == self.steps_per_block - 1
      k = int(mean_masks) if last else int(mean_masks * (1 - t_next / t))
      keep = np.arange(len(ranked)) < k
      if 0 < k < len(ranked):
        self.margins.append(ranked[k - 1] - ranked[k])
    for rank in np.flatnonzero(keep):
      position = masked[order[rank]]
      self.x[row, s + position] = proposals[order[rank]][0]


def check_against_reference(trace, ref):
  assert min(ref.margins) > MARGIN, "the test case is decided by rounding; change the seed or the head scale"
  nfe = int(trace.nfe)
  assert nfe == ref.nfe
  np.testing.assert_array_equal(np.asarray(trace.tokens), ref.x)
  np.testing.assert_array_equal(np.asarray(trace.decode_step), ref.decode_step)
  np.testing.assert_array_equal(np.asarray(trace.active_rows)[:nfe], np.stack(ref.active))
  np.testing.assert_array_equal(np.asarray(trace.computed_queries)[:nfe], np.array(ref.queries))
  if trace.stats is not None:
    stats = np.asarray(trace.stats["incoming_attention"])
    np.testing.assert_allclose(stats[:nfe], np.stack(ref.incoming), atol=2e-5)


# ---------------------------------------------------------------------------------------------------------

THRESHOLD = 0.7
HEAD_MEAN = StatsSpec(incoming_attention=True, per_head=False)


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_threshold_matches_reference(cache):
  """Given with a prompt mask of ones (no padding): with the prefix cache, the padded batch's test's program."""
  options = dream.DreamOptions(gen_length=8, block_length=4, threshold=THRESHOLD, cache=cache)
  trace = dream.diffusion_generate(params(), prompts(), config=CONFIG, options=options,
                                   prompt_mask=np.ones((2, 5), np.int32), setup=RunSetup(stats_spec=HEAD_MEAN))
  ref = Reference(prompts(), None, 8, 4, cache, threshold=THRESHOLD)
  check_against_reference(trace, ref)
  per_row_step = np.stack(ref.transfers)  # tokens each row committed at each threshold step
  assert per_row_step.max() == 3 and np.sum(per_row_step >= 2) >= 3, per_row_step
  assert ref.nfe <= 6  # 8 tokens per row in 2 block-start steps + at most 4 threshold steps
  if cache != "none":  # the cache's approximation shows in this case
    exact = Reference(prompts(), None, 8, 4, "none", threshold=THRESHOLD)
    assert not np.array_equal(ref.decode_step, exact.decode_step)


def test_factor_matches_reference():
  options = dream.DreamOptions(gen_length=12, block_length=4, factor=1.0, cache="dual", factor_rule="dllm")
  trace = dream.diffusion_generate(params(), prompts(seed=2), config=CONFIG, options=options)
  ref = Reference(prompts(seed=2), None, 12, 4, "dual", factor=1.0)
  check_against_reference(trace, ref)
  assert np.stack(ref.transfers).max() == 3


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_quota_matches_reference(cache):
  options = dream.DreamOptions(gen_length=8, steps=8, block_length=4, alg="entropy", cache=cache)
  trace = dream.diffusion_generate(params(), prompts(seed=1), config=CONFIG, options=options)
  ref = Reference(prompts(seed=1), None, 8, 4, cache, steps=8, alg="entropy")
  check_against_reference(trace, ref)
  assert ref.nfe == 8  # steps / num_blocks = 4 calls per block


@pytest.mark.parametrize("rule", [dict(threshold=THRESHOLD), dict(steps=8, alg="entropy")])
def test_blocks_of_one_position_are_their_block_start_steps(rule):
  """B = 1: each block is its block-start step alone (one whole-sequence call, the same in every cache mode),
  with the quota (2 steps per block by the options) as with the threshold."""
  traces = [dream.diffusion_generate(params(), prompts(), config=CONFIG, options=dream.DreamOptions(
      gen_length=4, block_length=1, cache=cache, **rule)) for cache in ("none", "prefix", "dual")]
  for trace in traces:
    assert int(trace.nfe) == 4
    np.testing.assert_array_equal(np.asarray(trace.decode_step), [np.arange(4)] * 2)
    np.testing.assert_array_equal(np.asarray(trace.tokens), np.asarray(traces[0].tokens))


def _forwards_traced(monkeypatch, options):
  """How many model forwards tracing the sampler program of `options` (a [2, 5] prompt) calls."""
  calls, forward = [], model_call.forward
  monkeypatch.setattr(model_call, "forward", lambda *args, **kwargs: calls.append(1) or forward(*args, **kwargs))
  jax.make_jaxpr(lambda p: dream.diffusion_generate(p, prompts(), config=CONFIG, options=options).tokens)(params())
  return len(calls)


def test_no_cache_and_dual_cache_trace_one_step_whatever_the_number_of_blocks(monkeypatch):
  """No cache and the dual cache: one phase (the block in the carry) traces the block-start call and the block
  call twice (the step body and the shape probe) for 2 blocks as for 8; the prefix cache, a phase per block."""
  counts = {(cache, gen): _forwards_traced(monkeypatch, dream.DreamOptions(
      gen_length=gen, block_length=4, threshold=0.55, cache=cache)) for cache in ("none", "dual", "prefix")
            for gen in (8, 32)}
  assert counts["none", 8] == counts["none", 32] == counts["dual", 8] == counts["dual", 32] == 4
  assert (counts["prefix", 8], counts["prefix", 32]) == (5, 17)


def padded_batch():
  """([2, 5] prompts, the first a 3-token prompt left-padded, prompt mask, the short prompt); the shape of
  `prompts()`, so that a test of both shares its compiled program."""
  rng = np.random.default_rng(7)
  short, long = rng.integers(3, 200, size=3).astype(np.int32), rng.integers(3, 200, size=5).astype(np.int32)
  batch = np.full((2, 5), PAD, np.int32)
  batch[0, 2:], batch[1] = short, long
  mask = (np.arange(5)[None, :] >= np.array([[2], [0]])).astype(np.int32)
  return batch, mask, short


def test_padded_batch_matches_reference_and_row_alone():
  batch, mask, short = padded_batch()
  options = dream.DreamOptions(gen_length=8, block_length=4, threshold=THRESHOLD, cache="prefix")
  together = dream.diffusion_generate(params(), batch, config=CONFIG, options=options, prompt_mask=mask,
                                      setup=RunSetup(stats_spec=HEAD_MEAN))
  check_against_reference(together, Reference(batch, mask, 8, 4, "prefix", threshold=THRESHOLD))
  nfe = int(together.nfe)
  assert not np.all(np.asarray(together.active_rows)[:nfe]), "no row waited: the case does not test waiting"
  alone = dream.diffusion_generate(params(), short[None], config=CONFIG, options=options)
  np.testing.assert_array_equal(np.asarray(together.generated)[0], np.asarray(alone.generated)[0])
  assert int(together.row_nfe[0]) == int(alone.row_nfe[0]) == int(alone.nfe)


def test_sampled_row_alone_equals_padded_batch_with_row_keys():
  batch, mask, short = padded_batch()
  options = dream.DreamOptions(gen_length=8, block_length=4, threshold=0.3, cache="dual", temperature=0.8, top_k=40)
  row_keys = jax.random.split(jax.random.key(5), 2)
  together = dream.diffusion_generate(params(), batch, config=CONFIG, options=options, prompt_mask=mask,
                                      key=row_keys)
  alone = dream.diffusion_generate(params(), short[None], config=CONFIG, options=options, key=row_keys[:1])
  np.testing.assert_array_equal(np.asarray(together.generated)[0], np.asarray(alone.generated)[0])
  assert int(together.row_nfe[0]) == int(alone.nfe)


def test_compiled_loop_equals_python_loop():
  batch, mask, _ = padded_batch()
  options = dream.DreamOptions(gen_length=8, steps=6, block_length=4, alg="topk_margin", alg_temp=0.5,
                               temperature=0.7, top_p=0.9, cache="dual")
  kw = dict(config=CONFIG, options=options, key=jax.random.key(4), prompt_mask=mask, sink_top_k=2,
            stats_spec=HEAD_MEAN)
  scan = dream.diffusion_generate(params(), batch, **kw)
  python = dream.diffusion_generate(params(), batch, loop="python", **kw)
  for name in ("tokens", "decode_step", "nfe", "active_rows", "computed_queries", "top_sinks"):
    np.testing.assert_array_equal(np.asarray(getattr(scan, name)), np.asarray(getattr(python, name)), err_msg=name)
  np.testing.assert_allclose(np.asarray(scan.stats["incoming_attention"]),
                             np.asarray(python.stats["incoming_attention"]), atol=1e-5)


def test_statistics_layout_query_groups_and_computed_queries():
  options = dream.DreamOptions(gen_length=8, block_length=4, threshold=0.9, cache="prefix")
  spec = StatsSpec(incoming_attention=True, per_head=False, query_groups=3)
  trace = dream.diffusion_generate(params(), prompts(), config=CONFIG, options=options,
                                   setup=RunSetup(stats_spec=spec, sink_top_k=1))
  nfe, lp, total = int(trace.nfe), 5, 13
  max_steps = 2 * 4  # per block: the block-start step and at most B - 1 threshold steps
  stats = np.asarray(trace.stats["incoming_attention"])
  assert stats.shape == (max_steps, CONFIG.n_layers, 2, 3, total)
  assert np.asarray(trace.top_sinks).shape == (max_steps, CONFIG.n_layers, 2, 1)
  assert 2 < nfe < max_steps
  assert np.all(stats[nfe:] == 0) and np.all(np.asarray(trace.computed_queries)[nfe:] == 0)
  queries = np.asarray(trace.computed_queries)[:nfe]
  openings = np.flatnonzero(queries[:, 0] == 0)
  assert openings[0] == 0 and len(openings) == 2
  np.testing.assert_array_equal(queries[openings], [[0, total]] * 2)
  decode_step = np.asarray(trace.decode_step)
  for i in range(nfe):
    if i not in openings:
      block = int(np.sum(openings <= i)) - 1
      np.testing.assert_array_equal(queries[i], [lp + 4 * block, total])
    # every query row sums to one: per group, the column sums add up to the group's queries at that call
    positions = np.arange(queries[i, 0], queries[i, 1])
    generated = positions[positions >= lp] - lp
    masked = np.sum((decode_step[:, generated] >= i) | (decode_step[:, generated] < 0), axis=1)
    counts = np.stack([masked, len(generated) - masked, np.full(2, np.sum(positions < lp))], axis=1)
    np.testing.assert_allclose(stats[i].sum(-1), np.broadcast_to(counts, (CONFIG.n_layers, 2, 3)), atol=1e-4)
  decoded_at_openings = np.isin(decode_step, openings).sum(axis=1)
  np.testing.assert_array_equal(decoded_at_openings, [2, 2])  # each block-start step commits exactly one token


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_previous_sink_masking_in_every_mode(cache):
  options = dream.DreamOptions(gen_length=8, block_length=4, threshold=0.7, cache=cache)
  spec = StatsSpec(incoming_attention=True, per_head=True)
  trace = dream.diffusion_generate(params(), prompts(), config=CONFIG, options=options,
                                   setup=RunSetup(stats_spec=spec, sink_top_k=1,
                                                  intervention=MaskPreviousSinks(top_k=1), record_intervention=True))
  nfe, record = int(trace.nfe), np.asarray(trace.intervention_record)
  assert record.shape[0] == 8 and record.shape[2:] == (2, CONFIG.n_heads, 13)
  assert not np.any(np.asarray(trace.tokens) == MASK)
  # the keys masked at each call are, per row, the top sink in each layer and head of the row's last call
  # before it at which it decoded (a row waiting for the batch keeps its masker state)
  top = np.asarray(trace.top_sinks)[..., 0]  # [max_steps, L, B, N]
  active = np.asarray(trace.active_rows)
  for step in range(1, nfe):
    for row in range(2):
      last = max(j for j in range(step) if active[j, row])
      np.testing.assert_array_equal(record[step, :, row], np.arange(13) == top[last, :, row, :, None],
                                    err_msg=f"step {step} row {row}")
  assert not active[:nfe].all(), "no row waited: the test would not check keep_rows"


def test_errors_are_clear():
  with pytest.raises(ValueError, match="block_length"):
    dream.DreamOptions(threshold=0.9)
  with pytest.raises(ValueError, match="block_length"):
    dream.DreamOptions(cache="dual")
  with pytest.raises(ValueError, match="multiple of block_length"):
    dream.DreamOptions(gen_length=10, block_length=4, threshold=0.9)
  with pytest.raises(ValueError, match="not both"):
    dream.DreamOptions(gen_length=8, block_length=4, threshold=0.9, factor=1.0)
  with pytest.raises(ValueError, match="p\\(x0\\)"):
    dream.DreamOptions(gen_length=8, block_length=4, threshold=0.9, alg="entropy")
  with pytest.raises(ValueError, match="alg_temp"):
    dream.DreamOptions(gen_length=8, block_length=4, threshold=0.9, alg_temp=0.5)
  with pytest.raises(ValueError, match="origin"):
    dream.DreamOptions(gen_length=8, steps=8, block_length=4)
  with pytest.raises(ValueError, match="multiple of the number of blocks"):
    dream.DreamOptions(gen_length=8, steps=5, block_length=4, alg="entropy")
  with pytest.raises(ValueError, match="at least 2 steps per block"):
    dream.DreamOptions(gen_length=8, steps=2, block_length=4, alg="entropy")
  with pytest.raises(ValueError, match="cache"):
    dream.DreamOptions(gen_length=8, block_length=4, threshold=0.9, cache="both")
  with pytest.raises(ValueError, match="threshold"):
    dream.DreamOptions(gen_length=8, block_length=4, threshold=1.5)
