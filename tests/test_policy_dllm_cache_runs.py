"""dLLM-Cache runs as a compute policy (issue 36): a whole LLaDA run at temperature 0 against a NumPy replay of
the official hooks written here (maomaocun/dLLM-cache `cache_hook_LLaDA.py` as read: per-layer caches of K, V
before RoPE, attention and feed-forward outputs; the four refresh branches; the lowest-similarity response
positions; layer 0 always refreshed, and not), the reuse path equal to a full forward when it recomputes
everything, the skipped work out of XLA's FLOP count, a row alone equal to the row in its batch, and bad
knobs refused in one line."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlm_jax.config import preset
from dlm_jax.instrument.stats import StatsSpec
from dlm_jax.model import Compute, KVCache, forward, init_params
from dlm_jax.model.compute_subset import ComputeSubset
from dlm_jax.model.reuse_layers import LayerReuse, ReuseCache
from dlm_jax.policy import cost
from dlm_jax.policy.registry import parse_policy
from dlm_jax.sampling import llada
from dlm_jax.sampling.run_setup import RunSetup

try:
  from tests import numpy_transformer as ref
except ImportError:  # run from inside tests/
  import numpy_transformer as ref

jax.config.update("jax_default_matmul_precision", "highest")

CONFIG = preset("tiny-llada")
OPTIONS = llada.LLaDAOptions(gen_length=8, steps=8, block_length=4)
RATIO = {True: 0.25, False: 0.125}
"""transfer_ratio by refresh_layer0. Without the quirk, layer 0's input is the token embeddings: an unchanged
token's fresh and cached values are equal, their similarity 1 up to rounding, so only the token each step
decoded (ratio 1/8 of 8) is chosen by its value and not by a rounding tie (torch's among exact ties)."""
MASK = CONFIG.mask_token_id


@functools.lru_cache(maxsize=None)
def _setup():
  params = init_params(CONFIG, jax.random.key(3))
  prompt = np.random.default_rng(4).integers(3, 200, size=(2, 6)).astype(np.int32)
  return params, prompt


@functools.lru_cache(maxsize=None)
def _run(refresh_layer0: bool, rows: tuple[int, ...] = (0, 1)):
  params, prompt = _setup()
  policy = parse_policy(f"dllm_cache:prompt_interval_steps=3,gen_interval_steps=2,"  # every branch in 8 calls
                        f"transfer_ratio={RATIO[refresh_layer0]},refresh_layer0={refresh_layer0}")
  return llada.generate(params, prompt[list(rows)], config=CONFIG, options=OPTIONS,
                        setup=RunSetup(policy=policy, batch_invariant=True,
                                       stats_spec=StatsSpec(incoming_attention=True, per_head=False)))


def _hook_layer(p, layer, x, cache, call, settings, prompt_length, config=CONFIG):
  """Block `layer` (float64 weights p, `numpy_transformer._flat` names; q/k/v biases where p has them, grouped
  keys) of model call `call` (1-based) under the official hook (float64): x [B, S, D] -> x; cache: this layer's
  "k" (before RoPE), "v" [B, S, K·H], "attn", "mlp" [B, S, D], rewritten in place. Returns the recomputed positions
  [B, S]."""
  c = config
  w = lambda name: p[f"blocks.{name}"][layer]  # noqa: E731
  b, s, _ = x.shape
  p_len, g = prompt_length, s - prompt_length
  first = layer == 0 and settings["refresh_layer0"]
  refresh_prompt = (call - 1) % settings["prompt_interval_steps"] == 0 or first  # the official 1-based counter
  refresh_gen = (call - 1) % settings["gen_interval_steps"] == 0 or first
  count = int(g * settings["transfer_ratio"])
  normed = ref._rms(x, w("attn_norm.weight"), c.norm_eps)
  rows = [list(range(p_len)) * refresh_prompt + list(range(p_len, s)) * refresh_gen for _ in range(b)]
  if not refresh_gen and count > 0:  # refresh_index: cosine similarity of fresh and cached response values
    fresh = ref._project(normed[:, p_len:], p, layer, "v")
    cached = cache["v"][:, p_len:]
    similarity = np.sum(fresh * cached, -1) / np.maximum(np.linalg.norm(fresh, axis=-1) *
                                                         np.linalg.norm(cached, axis=-1), 1e-8)
    for row in range(b):
      rows[row] += (np.argsort(similarity[row], kind="stable")[:count] + p_len).tolist()
    cache["v"][:, p_len:] = fresh
  recomputed = np.zeros((b, s), bool)
  positions = np.arange(s, dtype=np.float64)
  heads = lambda a: a.reshape(a.shape[0], -1, c.head_dim)  # noqa: E731
  group = c.n_heads // c.n_kv_heads
  for row in range(b):
    at = np.asarray(rows[row], int)
    recomputed[row, at] = True
    cache["k"][row, at] = ref._project(normed[row, at], p, layer, "k")
    refreshed = at[:len(at) - (count if not refresh_gen and count > 0 else 0)]
    cache["v"][row, refreshed] = ref._project(normed[row, refreshed], p, layer, "v")
    q = ref._rope(heads(ref._project(normed[row, at], p, layer, "q"))[None], at.astype(np.float64), c.rope_theta)[0]
    k = np.repeat(ref._rope(heads(cache["k"][row])[None], positions, c.rope_theta)[0], group, axis=1)
    scores = np.einsum("qnh,knh->nqk", q, k) / np.sqrt(c.head_dim)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    values = np.repeat(heads(cache["v"][row]), group, axis=1)
    cache["attn"][row, at] = np.einsum("nqk,knh->qnh", probs, values).reshape(len(at), -1) @ w("attn.o.kernel")
  x = x + cache["attn"]
  for row in range(b):
    at = np.asarray(rows[row], int)
    h = ref._rms(x[row, at], w("mlp_norm.weight"), c.norm_eps)
    cache["mlp"][row, at] = (ref._silu(h @ w("mlp.gate.kernel")) * (h @ w("mlp.up.kernel"))) @ w("mlp.down.kernel")
  return x + cache["mlp"], recomputed


def official_run(params, prompt, settings):
  """The official LLaDA generate (temperature 0, low-confidence remasking, blocks) with the hooks registered:
  (tokens [B, S], decode step [B, G], NFE, recomputed [steps, B, L, S])."""
  c = CONFIG
  p = {k: np.asarray(v, np.float64) for k, v in ref._flat(params).items()}
  b, lp = prompt.shape
  gen, block, steps = OPTIONS.gen_length, OPTIONS.block_length, OPTIONS.steps
  x = np.full((b, lp + gen), MASK, np.int64)
  x[:, :lp] = prompt
  caches = [{name: np.zeros((b, lp + gen, c.d_model)) for name in ("k", "v", "attn", "mlp")}
            for _ in range(c.n_layers)]
  per_block = steps // (gen // block)
  decode_step = np.full((b, gen), -1)
  records, nfe = [], 0
  for start in range(lp, lp + gen, block):
    masks = (x[:, start:start + block] == MASK).sum(1)
    schedule = [[m // per_block + (s < m % per_block) for s in range(per_block)] for m in masks]
    for s in range(per_block):
      nfe += 1
      h, recomputed = p["embed.embedding"][x], []
      for layer in range(c.n_layers):
        h, rows = _hook_layer(p, layer, h, caches[layer], nfe, settings, lp)
        recomputed.append(rows)
      records.append(np.stack(recomputed, 1))
      logits = ref.readout(params, h, c)
      x0 = np.argmax(logits, -1)
      probs = np.exp(logits - logits.max(-1, keepdims=True))
      confidence = np.take_along_axis(probs / probs.sum(-1, keepdims=True), x0[..., None], -1)[..., 0]
      confidence[:, start + block:] = -np.inf
      confidence = np.where(x == MASK, confidence, -np.inf)
      for row in range(b):
        chosen = np.argsort(-confidence[row], kind="stable")[:schedule[row][s]]
        x[row, chosen] = x0[row, chosen]
        decode_step[row, chosen - lp] = nfe - 1
  return x, decode_step, nfe, np.stack(records)


@pytest.mark.parametrize("refresh_layer0", [True, False])
def test_a_run_replays_the_official_hooks(refresh_layer0):
  params, prompt = _setup()
  settings = dict(prompt_interval_steps=3, gen_interval_steps=2, transfer_ratio=RATIO[refresh_layer0],
                  refresh_layer0=refresh_layer0)
  tokens, decode_step, nfe, recomputed = official_run(params, prompt, settings)
  trace = _run(refresh_layer0)
  np.testing.assert_array_equal(np.asarray(trace.tokens), tokens)
  np.testing.assert_array_equal(np.asarray(trace.decode_step), decode_step)
  assert int(trace.nfe) == nfe == OPTIONS.steps
  np.testing.assert_array_equal(np.asarray(trace.policy_record), recomputed)
  n = 2 if refresh_layer0 else 1
  counts = [14, n, 8, 6 + n, 8, n, 14, n]  # per call at a layer after the first: full, adaptive, response, prompt…
  np.testing.assert_array_equal(recomputed[:, 0, 1].sum(-1), counts)
  assert recomputed[3, :, 1, :6].all()
  np.testing.assert_array_equal(recomputed[:, 0, 0].sum(-1), [14] * 8 if refresh_layer0 else counts)
  incoming = np.asarray(trace.stats["incoming_attention"])  # [steps, L, B, S]: over each layer's recomputed queries
  np.testing.assert_allclose(incoming.sum(-1), np.swapaxes(recomputed.sum(-1), 1, 2), rtol=1e-5)


def test_a_row_alone_decodes_as_in_its_batch():
  both = _run(True)
  for row in range(2):
    alone = _run(True, (row,))
    np.testing.assert_array_equal(np.asarray(alone.tokens)[0], np.asarray(both.tokens)[row])
    np.testing.assert_array_equal(np.asarray(alone.policy_record)[:, 0], np.asarray(both.policy_record)[:, row])


@functools.partial(jax.jit, static_argnames=("refresh_prompt", "refresh_gen", "count", "config"))
def _reuse_call(params, tokens, cache, *, refresh_prompt, refresh_gen, count, config=CONFIG):
  reuse = LayerReuse(attn=cache.attn, ffn=cache.ffn, prompt_length=6, count=count, refresh_prompt=refresh_prompt,
                     refresh_gen=refresh_gen, first_layer_full=True)
  queries = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32)[None], tokens.shape)
  return forward(params, tokens, config=config,
                 compute=Compute(cache=cache.kv, subset=ComputeSubset(queries, reuse=reuse)))


def test_recomputing_everything_is_the_full_forward():
  params, prompt = _setup()
  before = np.concatenate([prompt, np.full((2, 8), MASK, np.int32)], axis=1)
  after = before.copy()
  after[:, [7, 10]] = [[21, 22], [23, 24]]
  refresh = _reuse_call(params, jnp.asarray(before), ReuseCache.zeros(CONFIG, 2, 14), refresh_prompt=True,
                        refresh_gen=True, count=0)
  np.testing.assert_allclose(refresh.logits, ref.forward_sites(params, before, CONFIG)[0], atol=2e-5)
  every = _reuse_call(params, jnp.asarray(after), refresh.cache, refresh_prompt=True, refresh_gen=False, count=8)
  np.testing.assert_allclose(every.logits, ref.forward_sites(params, after, CONFIG)[0], atol=2e-5)
  assert np.asarray(every.cache.recomputed).all()


def test_the_skipped_work_leaves_the_flop_count():
  config = dataclasses.replace(CONFIG, n_layers=1)  # XLA counts a scanned layer body once
  params = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))  # shapes only: nothing runs
  s, p, n = 64, 16, 6
  tokens = jnp.zeros((1, s), jnp.int32)
  cache = ReuseCache.zeros(config, 1, s)

  def flops(fn):
    return jax.jit(fn).lower(params, tokens, cache).compile().cost_analysis()["flops"]

  full = flops(lambda w, t, c: forward(w, t, config=config, compute=Compute(cache=c.kv)).logits)
  queries = jnp.arange(s, dtype=jnp.int32)[None]
  reuse = flops(lambda w, t, c: forward(w, t, config=config, cache=c.kv, subset=ComputeSubset(queries, reuse=LayerReuse(
      attn=c.attn, ffn=c.ffn, prompt_length=p, count=n, refresh_prompt=False, refresh_gen=False,
      first_layer_full=False))).logits)
  head = cost.head_flops(config, s)
  expected_full = cost.reuse_layer_flops(config, s, s) + head
  expected_reuse = cost.reuse_layer_flops(config, n, s, value_rows=s - p) + head
  assert expected_full == cost.trunk_flops(config, s, s) + head
  assert abs(full / expected_full - 1) < 0.1 and abs(reuse / expected_reuse - 1) < 0.1, (full, reuse)
  assert reuse < 0.5 * full


@pytest.mark.parametrize("text, message", [
    ("dllm_cache:transfer_ratio=1.5", r"dllm_cache transfer_ratio must be a number in \[0, 1\]"),
    ("dllm_cache:gen_interval_steps=0", "dllm_cache gen_interval_steps must be an int >= 1, got 0"),
    ("dllm_cache:rho=0.1", "policy dllm_cache has no knob 'rho'"),
])
def test_bad_knobs_are_refused_in_one_line(text, message):
  with pytest.raises(ValueError, match=message):
    parse_policy(text)


def test_models_it_cannot_run_are_refused_before_compiling():
  with pytest.raises(ValueError, match="policy dllm_cache: per-layer reuse runs dense bidirectional blocks"):
    parse_policy("dllm_cache").check(preset("tiny-llada2"), "llada")
  with pytest.raises(ValueError, match="reads every key at every layer"):
    forward(_setup()[0], jnp.zeros((1, 4), jnp.int32), config=CONFIG, cache=KVCache.zeros(CONFIG, 1, 4),
            subset=ComputeSubset(jnp.zeros((1, 4), jnp.int32), jnp.zeros((2, 1, 1), jnp.int32),
                                 reuse=LayerReuse(attn=None, ffn=None, prompt_length=2, count=1, refresh_prompt=False,
                                            refresh_gen=False, first_layer_full=True)))
