"""d2Cache with the official loop's other decodings: Dream (logits at i predict i + 1) under the certainty-prior
rule, and LLaDA's threshold and factor parallel decoding. Each run is compared with a whole-run replay of
Research dLLM's `vanilla_generate` + `d2Cache` (Kamichanw/d2Cache `src/generation/vanilla.py`, `src/cache/d2cache.py`)
written here in float64 NumPy, at temperature 0: tokens, decode order, NFE and every step's computed positions."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

try:
  from tests import numpy_transformer as ref
  from tests.test_policy_d2cache import replay_density, replay_query_mask, replay_rollout, replay_top_up
except ImportError:  # run from inside tests/
  import numpy_transformer as ref
  from test_policy_d2cache import replay_density, replay_query_mask, replay_rollout, replay_top_up

from dlm_jax.config import preset
from dlm_jax.model import init_params
from dlm_jax.policy.d2cache import D2CacheSettings
from dlm_jax.policy.registry import make_policy, parse_policy
from dlm_jax.sampling import dream, llada, parallel
from dlm_jax.sampling.decoding_rules import CertaintyPrior, EBSampler
from dlm_jax.session import decoding_mode
from dlm_jax.sampling.run_setup import RunSetup

jax.config.update("jax_default_matmul_precision", "highest")

LLADA, DREAM = preset("tiny-llada"), preset("tiny-dream")
PROMPT_LENGTH, GEN, BLOCK = 6, 16, 8
KNOBS = dict(current_k=4, inflate_w=2, rollout_p=0.2, query_buckets=3)
CLEAN = dict(KNOBS, frozen_confidence=False, top_up=False)  # the clean rules: a changing cache, rows alone
PARALLEL = dict(KNOBS, inflate_w=4)  # the docs' semi-AR + parallel setting: inflate_w 4
SHARPEN = 6.0  # the LM head scaled so that confidences spread over (0, 1) and parallel steps decode several tokens


@functools.partial(jax.jit, static_argnums=(0, 1))
def sharpened(config, seed: int):
  """Random parameters of `config`, the LM head scaled by SHARPEN and (Dream) random q/k/v biases: one compiled
  program (eagerly, each initialiser and shape is a program of its own)."""
  params = init_params(config, jax.random.key(seed))
  params = dict(params, lm_head={"kernel": params["lm_head"]["kernel"] * SHARPEN})
  if config.qkv_bias:
    attn = dict(params["blocks"]["attn"])
    for i, name in enumerate("qkv"):
      bias = attn[name]["bias"]
      attn[name] = dict(attn[name], bias=0.3 * jax.random.normal(jax.random.key(seed + 10 + i), bias.shape))
    params = dict(params, blocks=dict(params["blocks"], attn=attn))
  return params


@pytest.fixture(scope="module")
def prompt():
  return jax.random.randint(jax.random.key(1), (2, PROMPT_LENGTH), 3, 200)


def numpy_call(config, params, tokens, cache, computed):
  """One d2Cache model call in float64 NumPy for `config` (q/k/v biases when it has them): the positions
  computed [B, S] run through every layer, their keys and values (after RoPE) overwrite `cache` (per layer
  (keys, values) [B, S, K, H]; None: the first call), every query reads all S cached positions. Returns (model
  outputs [B, S, V], zeros where not computed; the new cache; head-mean attention rows [L, B, S, S])."""
  c = config
  p = {name: np.asarray(value, np.float64) for name, value in ref._flat(params).items()}
  b, s = tokens.shape
  group = c.n_heads // c.n_kv_heads
  zeros = lambda: np.zeros((b, s, c.n_kv_heads, c.head_dim))  # noqa: E731
  cache = [(zeros(), zeros()) for _ in range(c.n_layers)] if cache is None else [(k.copy(), v.copy())
                                                                                  for k, v in cache]
  logits, rows = np.zeros((b, s, c.vocab_size)), np.zeros((c.n_layers, b, s, s))
  for row in range(b):
    at = np.nonzero(computed[row])[0]
    if not len(at):
      continue
    x = p["embed.embedding"][tokens[row, at]][None]
    for layer in range(c.n_layers):
      w = lambda name: p[f"blocks.{name}"][layer]  # noqa: E731

      def project(h, name):
        return h @ w(f"attn.{name}.kernel") + (w(f"attn.{name}.bias") if c.qkv_bias else 0.0)

      h = ref._rms(x, w("attn_norm.weight"), c.norm_eps)
      shape = (1, len(at), -1, c.head_dim)
      q = ref._rope(project(h, "q").reshape(shape), at.astype(np.float64), c.rope_theta)[0]
      keys, values = cache[layer]
      keys[row, at] = ref._rope(project(h, "k").reshape(shape), at.astype(np.float64), c.rope_theta)[0]
      values[row, at] = project(h, "v").reshape(shape)[0]
      scores = np.einsum("tnh,snh->nts", q, np.repeat(keys[row], group, axis=1)) / np.sqrt(c.head_dim)
      probs = np.exp(scores - scores.max(-1, keepdims=True))
      probs = probs / probs.sum(-1, keepdims=True)
      rows[layer, row, at] = probs.mean(0)
      z = np.einsum("nts,snh->tnh", probs, np.repeat(values[row], group, axis=1))
      x = x + z.reshape(1, len(at), -1) @ w("attn.o.kernel")
      h = ref._rms(x, w("mlp_norm.weight"), c.norm_eps)
      x = x + (ref._silu(h @ w("mlp.gate.kernel")) * (h @ w("mlp.up.kernel"))) @ w("mlp.down.kernel")
    logits[row, at] = (ref._rms(x, p["final_norm.weight"], c.norm_eps) @ p["lm_head.kernel"])[0]
  return logits, cache, rows


def transfer(scores, candidates, quota, threshold, factor):
  """`confidence_unmasking` of one row: scores [G] (−inf off the candidates), candidates [G] bool, quota int."""
  order = np.argsort(-np.where(candidates, scores, -np.inf), kind="stable")
  picked = None
  if threshold is not None:
    picked = list(np.nonzero(candidates & (scores >= threshold))[0])
  elif factor is not None:
    ranked = np.sort(scores[candidates])[::-1]
    n = 0
    for n in range(1, len(ranked) + 1):
      if (n + 1) * (1 - ranked[n - 1]) >= factor:
        break
    picked = list(order[:n - 1])
  if picked is None or len(picked) < quota:
    k = min(quota, int(candidates.sum()))
    if k < candidates.sum():
      assert scores[order[k - 1]] > scores[order[k]], "the replay covers tie-free transfers"
    picked = list(order[:k])
  return picked


def replay(config, params, prompt, settings, steps, sigma=None, threshold=None, factor=None):
  """The official run at temperature 0: Research dLLM's `vanilla_generate` (its blocks, `get_num_transfer_tokens`,
  `generate_step`: Dream's logits shifted one position right, certainty-prior scores when sigma is set,
  `confidence_unmasking` with threshold or factor) with `d2Cache`'s hooks in their order, the rows that do not
  generate at a step left out of it; settings: d2cache's knobs, frozen_confidence=False and top_up=False replaying
  our clean rules (the cache updated where the output read was computed; no top-up). Returns (tokens [B, S],
  decode step [B, G], NFE, computed positions per call [calls, B, S] bool)."""
  mask, shift = config.mask_token_id, config.logit_shift
  prompt = np.asarray(prompt)
  b, p = prompt.shape
  s = p + GEN
  x = np.concatenate([prompt, np.full((b, GEN), mask)], axis=1)
  decode_step = np.full((b, GEN), -1)
  cache = conf = full_q = importance = density = None
  calls = []
  per_block = steps // (GEN // BLOCK)
  for block in range(GEN // BLOCK):
    block_mask = np.zeros((b, GEN), bool)
    block_mask[:, block * BLOCK:(block + 1) * BLOCK] = True
    schedule = BLOCK // per_block + (np.arange(per_block) < BLOCK % per_block)
    for i in range(per_block):
      remaining = x[:, p:] == mask
      active = (remaining & block_mask).any(-1)
      if not active.any():
        break
      assert schedule[i] > 0
      if full_q is None:
        computed = np.ones((b, s), bool)
      elif settings.get("top_up", True):  # model_forward: the top-up over the generating rows, then x[active_q_mask]
        computed = replay_top_up(full_q, importance, density, active)
      else:
        computed = full_q.copy()
      computed &= active[:, None]
      calls.append(computed)
      logits, cache, rows = numpy_call(config, params, x, cache, computed)
      gen_logits = logits[:, p - shift:s - shift]  # prepare_logits_for_generation: Dream reads i - 1
      x0 = gen_logits.argmax(-1)
      probs = np.exp(gen_logits - gen_logits.max(-1, keepdims=True))
      confidence = np.where(remaining, (probs / probs.sum(-1, keepdims=True)).max(-1), -np.inf)
      scores = confidence * replay_density(~remaining, sigma) if sigma else confidence
      transferred = np.zeros((b, GEN), bool)
      for row in np.nonzero(active)[0]:
        transferred[row, transfer(scores[row], remaining[row] & block_mask[row], schedule[i], threshold, factor)] = True
      assert not np.any(transferred & (x0 == mask)), "the replay covers runs that never transfer the mask id"
      new = x.copy()
      new[:, p:] = np.where(transferred, x0, x[:, p:])
      decode_step[transferred] = len(calls) - 1
      # on_step_end, on the generating rows
      if conf is None:
        conf = confidence
      elif not settings.get("frozen_confidence", True):  # the clean rule: where the output read was computed
        conf = np.where(computed[:, p - shift:s - shift] & remaining, confidence, conf)
      step_importance = replay_rollout(rows, np.broadcast_to(np.arange(s), (b, s)), computed)
      q, step_density = replay_query_mask(make_policy("d2cache", **settings), new[:, p:] == mask, block_mask,
                                          transferred, conf, step_importance, shift == 1, active)
      if full_q is None:
        full_q, importance, density = q, step_importance, step_density
      else:
        full_q[active], importance[active], density[active] = q[active], step_importance[active], step_density[active]
      x = new
  return x, decode_step, len(calls), np.stack(calls)


def check_run(trace, expected):
  """The run equals the replay `expected` (tokens, decode step, NFE, computed positions per call), and skips work."""
  tokens, decode_step, nfe, computed = expected
  assert int(trace.nfe) == nfe
  np.testing.assert_array_equal(np.asarray(trace.computed_positions)[:nfe], computed)
  np.testing.assert_array_equal(trace.tokens, tokens)
  np.testing.assert_array_equal(trace.decode_step, decode_step)
  np.testing.assert_array_equal(np.asarray(trace.policy_record["count"])[1:nfe], computed[1:].sum(-1))
  assert computed[1:].sum(-1).max() < PROMPT_LENGTH + GEN  # the later calls skip positions


@pytest.fixture(scope="module")
def dream_params():
  return sharpened(DREAM, 0)


@pytest.fixture(scope="module")
def llada_params():
  return sharpened(LLADA, 0)


@pytest.mark.parametrize("knobs", [KNOBS, CLEAN])
def test_dream_under_the_certainty_prior_is_the_official_run(dream_params, prompt, knobs):
  options = dream.DreamOptions(gen_length=GEN, steps=GEN, block_length=BLOCK, rule=CertaintyPrior(sigma=10.0))
  trace = dream.diffusion_generate(dream_params, prompt, config=DREAM, options=options,
                                   setup=RunSetup(policy=make_policy("d2cache", **knobs)))
  expected = replay(DREAM, dream_params, prompt, knobs, GEN, sigma=10.0)
  check_run(trace, expected)
  assert expected[3][1:, :, PROMPT_LENGTH - 1].any()  # the last prompt token: generated position 0 was picked
  if knobs is CLEAN:  # the flag decides something
    frozen = replay(DREAM, dream_params, prompt, dict(knobs, frozen_confidence=True), GEN, sigma=10.0)
    assert not np.array_equal(frozen[3], expected[3])


@pytest.mark.parametrize("rule", [dict(threshold=0.5), dict(factor=2.0, factor_rule="research_dllm")])
def test_llada_parallel_decoding_is_the_official_run(llada_params, prompt, rule):
  options = llada.LLaDAOptions(gen_length=GEN, steps=GEN, block_length=BLOCK, **rule)
  trace = llada.generate(llada_params, prompt, config=LLADA, options=options,
                         setup=RunSetup(policy=make_policy("d2cache", **PARALLEL)))
  expected = replay(LLADA, llada_params, prompt, PARALLEL, GEN, threshold=rule.get("threshold"),
                    factor=rule.get("factor"))
  check_run(trace, expected)
  assert expected[2] < GEN  # some calls decode several tokens


def test_research_dllms_factor_rule_is_its_loop():
  rng = np.random.default_rng(3)
  confidence = np.concatenate([rng.uniform(0.0, 1.0, (40, 8)), 1.0 - rng.uniform(0.0, 0.05, (8, 8))])  # + all pass
  candidates = rng.random(confidence.shape) < 0.7
  candidates[:, 0] = True
  factor = 1.0
  transfer_rule = jax.jit(parallel.factor_transfer, static_argnums=(2, 3, 4))  # one program per scale, as sampled
  for scale in ("probability", "log_odds"):
    score = confidence if scale == "probability" else np.log(confidence) - np.log1p(-confidence)
    got = np.asarray(transfer_rule(jnp.asarray(score, jnp.float32), jnp.asarray(candidates), factor,
                                   "research_dllm", scale))
    for row in range(len(confidence)):
      want = np.zeros(8, bool)
      want[transfer(np.where(candidates[row], confidence[row], -np.inf), candidates[row], 1, None, factor)] = True
      np.testing.assert_array_equal(got[row], want, err_msg=f"{scale} row {row}")
  assert D2CacheSettings.published("dream", parallel=True) == D2CacheSettings(inflate_w=4)
  fields = decoding_mode.from_values("factor_research_dllm", factor=2.0, policy="d2cache").option_fields("llada")
  assert fields["factor_rule"] == "research_dllm" and fields["factor"] == 2.0


@pytest.mark.parametrize("run, message", [
    (lambda d, p, x: dream.diffusion_generate(d, x, config=DREAM, options=dream.DreamOptions(
        gen_length=GEN, steps=GEN, block_length=BLOCK, threshold=0.9), policy=parse_policy("d2cache")),
     r"not Dream's own sampler \(dream_blockwise\)"),
    (lambda d, p, x: dream.diffusion_generate(d, x, config=DREAM, options=dream.DreamOptions(
        gen_length=GEN, steps=GEN, rule=EBSampler()), policy=parse_policy("d2cache")),
     "policy d2cache runs with decoding rule certainty_prior .d2Cache's own decoding., not eb"),
    (lambda d, p, x: llada.generate(p, x, config=LLADA, options=llada.LLaDAOptions(
        gen_length=GEN, steps=GEN, block_length=BLOCK, threshold=0.9, cache="dual"), policy=parse_policy("d2cache")),
     "policy 'd2cache' does not compose with cache='dual'"),
    (lambda d, p, x: llada.generate(p, x, config=LLADA, options=llada.LLaDAOptions(
        gen_length=GEN, steps=GEN, block_length=BLOCK, threshold=0.9, window=4), policy=parse_policy("d2cache")),
     "policy d2cache does not run with a decoding window or EOS truncation"),
])
def test_what_still_cannot_run_is_refused_in_one_line(dream_params, llada_params, prompt, run, message):
  with pytest.raises(ValueError, match=message) as error:
    run(dream_params, llada_params, prompt)
  assert "\n" not in str(error.value)
