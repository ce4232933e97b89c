"""The decoding rules with the prefix / dual KV caches and under LLaDA's classifier-free guidance, against the
replays of tests/test_decoding_rules.py with their model calls replaced:

* caches: Research dLLM's order (Kamichanw/d2Cache `src/cache/prefix_cache.py`): a block's first call is a
  float64 NumPy forward of the whole row (tests/numpy_transformer.py) that keeps every layer's keys and values;
  the block's later calls compute the queries [s − shift, S − shift) (prefix) or [s − shift, e − shift)
  (dual), shift Dream's 1, over those cached keys and values, and every generated position no query
  predicts gets zero logits (Research dLLM scatters its outputs into zeros);
* CFG: the same jitted model forward on the row and on the row with its prompt masked, guided
  un + (w + 1)·(cond − un).

Temperature 0, tiny random LLaDA and Dream, two rows batched, each replayed alone: tokens, per-step commits,
last commit step and NFE equal. Also: KLASS on Dream ranks its fallback after top-k; the refusals."""

import dataclasses
import json

import numpy as np
import pytest

from dlm_jax.sampling import decoding_rules as dr, dream, llada
from dlm_jax.session import SessionError, decoding_mode
from dlm_jax.sampling.run_setup import RunSetup

try:
  from tests import numpy_transformer as ref
  from tests import test_decoding_rules as rules
except ImportError:  # run from inside tests/
  import numpy_transformer as ref
  import test_decoding_rules as rules

LP, GEN, MASK = rules.LP, rules.GEN, rules.MASK


class CachedCalls:
  """One row's model calls under Research dLLM's prefix or dual cache (module docstring): the refresh at each
  block's first call (a new block start), then the cached calls."""

  def __init__(self, cache: str, block: int, is_dream: bool):
    self.cache, self.block, self.shift = cache, block, int(is_dream)
    self.config, self.params = (rules.DREAM, rules.dream_params()) if is_dream else (rules.CONFIG, rules.params())
    self.lo, self.kv = None, None

  def __call__(self, tokens, lo):
    row = np.asarray(tokens)[None]
    s = row.shape[1]
    if lo != self.lo:
      self.lo = lo
      self.kv = ref.cached_kv(self.params, row, self.config)
      out = ref.forward_sites(self.params, row, self.config)[0][0]
      return np.concatenate([out[:1], out[:-1]]) if self.shift else out
    start = lo - self.shift
    stop = (s if self.cache == "prefix" else lo + self.block) - self.shift
    logits = np.zeros((s, self.config.vocab_size))
    logits[start + self.shift:stop + self.shift] = ref.subset_forward(self.params, row, self.config, self.kv,
                                                                      np.arange(start, stop)[None])[0]
    return logits


def guided_calls(scale: float):
  """LLaDA's CFG around the replays' model: the row, and the row with its prompt masked, guided."""
  def call(tokens, lo):
    del lo
    cond = rules.model_logits(tokens)
    un = rules.model_logits(np.concatenate([np.full(LP, MASK), tokens[LP:]]))
    return un + (scale + 1.0) * (cond - un)
  return call


def replay(original, batch, calls):
  """original(row) for each row with MODEL["calls"] from calls() (a fresh one per row)."""
  refs = []
  for row in batch:
    rules.MODEL["calls"] = calls()
    try:
      refs.append(original(row))
    finally:
      rules.MODEL["calls"] = None
  return refs


def check(trace, refs):
  for row, r in enumerate(refs):
    rules._check_row(trace, row, r)  # pylint: disable=protected-access
  assert int(trace.nfe) == max(len(r.committed) for r in refs)


RULES = ("eb_blocks", "klass", "pc", "certainty_prior")
CACHE_CASES = [(case, cache, family) for case in RULES for cache, family in
               (("prefix", "llada"), ("dual", "llada"), (("dual", "prefix")[RULES.index(case) % 2], "dream"))]
"""Each rule with both caches on LLaDA and one on Dream (alternating), to keep the compiled programs few."""


@pytest.mark.parametrize("case, cache, family", CACHE_CASES)
def test_rule_with_cache_matches_replay(case, cache, family):
  rule, layout, original = rules.CASES[case]
  batch = rules.prompts(2, seed=7)
  block = layout["block_length"]
  if family == "llada":
    trace = llada.generate(rules.params(), batch, config=rules.CONFIG,
                           options=llada.LLaDAOptions(gen_length=GEN, rule=rule, cache=cache, **layout))
  else:
    if case == "klass":  # LLaDA's KLASS code on Dream (its own has no blocks and no cache)
      rule = dataclasses.replace(rule, variant="llada_klass")
    trace = dream.diffusion_generate(rules.dream_params(), batch, config=rules.DREAM,
                                     options=dream.DreamOptions(gen_length=GEN, rule=rule, cache=cache, **layout))
  refs = replay(original, batch, lambda: CachedCalls(cache, block, family == "dream"))
  check(trace, refs)
  computed = np.asarray(trace.computed_queries)[: int(trace.nfe)]
  assert np.any(computed[:, 1] - computed[:, 0] < LP + GEN), "no call used the cache"
  if case != "pc":
    assert max(int(np.sum(c)) for r in refs for c in r.committed) > 1 or case == "certainty_prior"


@pytest.mark.parametrize("case", RULES)
def test_rule_under_cfg_matches_replay(case):
  rule, layout, original = rules.CASES[case]
  batch = rules.prompts(2, seed=8)
  trace = llada.generate(rules.params(), batch, config=rules.CONFIG,
                         options=llada.LLaDAOptions(gen_length=GEN, rule=rule, cfg_scale=1.5, **layout))
  check(trace, replay(original, batch, lambda: guided_calls(1.5)))


def test_dream_klass_fallback_ranks_after_top_k():
  """LLaDA's KLASS code on Dream ranks its fallback as KLASS's Dream code, by sample_tokens' p(x0) after top-k:
  with top_k=1 every p(x0) is 1, so the fallback takes the first masks of the block; the run equals the replay
  that renormalises over the top token, and commits otherwise than without top-k."""
  rule = dr.KLASS(conf_threshold=0.3, kl_threshold=1.0, variant="llada_klass")
  layout = dict(block_length=8, steps=8)
  batch = rules.prompts(2, seed=2)
  trace = dream.diffusion_generate(rules.dream_params(), batch, config=rules.DREAM,
                                   options=dream.DreamOptions(gen_length=GEN, rule=rule, top_k=1, **layout))
  rules.MODEL["dream"] = True
  try:
    refs = [rules.klass_original(row, rule, 4, 8, top_k=1) for row in batch]
    plain = [rules.klass_original(row, rule, 4, 8) for row in batch]
  finally:
    rules.MODEL["dream"] = False
  check(trace, refs)
  assert any(not np.array_equal(np.stack(a.committed), np.stack(b.committed)) if len(a.committed) == len(b.committed)
             else True for a, b in zip(refs, plain)), "top-k changed no fallback choice"


@pytest.mark.parametrize("make, message", [
    (lambda: llada.LLaDAOptions(gen_length=16, steps=16, block_length=8, rule=dr.WINO(), cache="dual"),
     "decoding rule wino does not run with cache='dual': its verification copy"),
    (lambda: dream.DreamOptions(gen_length=16, steps=16, block_length=8, rule=dr.WINO(), cache="prefix"),
     "decoding rule wino does not run with cache='prefix'"),
    (lambda: llada.LLaDAOptions(gen_length=16, steps=16, block_length=8, rule=dr.WINO(), cfg_scale=1.0),
     "decoding rule wino cannot be combined with cfg_scale"),
    (lambda: llada.LLaDAOptions(gen_length=16, steps=16, block_length=8, rule=dr.KLASS(), cfg_scale=1.0,
                                cache="dual"), "cannot be combined with cfg_scale > 0"),
    (lambda: llada.LLaDAOptions(gen_length=16, steps=16, block_length=8, rule=dr.EBSampler(), cache="dual",
                                dual_cache_forwards="steps_per_block"), "bounds a block's calls itself"),
    (lambda: llada.LLaDAOptions(gen_length=16, steps=16, block_length=8, rule=dr.KLASS(), logits_eos_inf=True),
     "decoding rule klass cannot be combined with logits_eos_inf"),
    (lambda: llada.LLaDAOptions(gen_length=16, steps=16, block_length=8, rule=dr.EBSampler(),
                                confidence_eos_eot_inf=True), "decoding rule eb cannot be combined with "
     "confidence_eos_eot_inf"),
    (lambda: dream.DreamOptions(gen_length=16, steps=16, block_length=8, rule=dr.EBSampler(), top_k=3),
     "decoding rule eb cannot be combined with top_p or top_k"),
    (lambda: dream.DreamOptions(gen_length=16, steps=16, block_length=8, rule=dr.EBSampler(), top_p=0.9),
     "decoding rule eb cannot be combined with top_p or top_k"),
])
def test_refused_in_one_line(make, message):
  with pytest.raises(ValueError, match=message) as info:
    make()
  assert "\n" not in str(info.value)


def test_modes_carry_the_rule_cache():
  mode = decoding_mode.from_values("klass", cache="dual")
  assert mode.cache == "dual" and mode.record() == {"decoding": "klass", "cache": "dual"}
  assert mode.spec == "klass:cache=dual" and decoding_mode.from_spec(mode.spec) == mode
  assert decoding_mode.DecodingMode.from_record(mode.record()) == mode
  assert mode.option_fields("llada") == {"rule": dr.KLASS(), "cache": "dual"}
  assert decoding_mode.from_values("eb").record() == {"decoding": "eb"}
  assert decoding_mode.from_spec("klass:cache=dual,kl_history_length=3") == decoding_mode.from_values(
      "klass", knobs=(("kl_history_length", 3),), cache="dual")
  for kwargs, message in [
      (dict(decoding="wino", cache="prefix"), "--decoding=wino does not run with --cache=prefix"),
      (dict(decoding="threshold", cache="dual"), "--cache=dual applies to the decoding rules"),
      (dict(decoding="eb", cache="full"), "--cache=full: expected one of none, prefix, dual"),
      (dict(decoding="eb", cache="dual", policy="dkv_cache"), "--policy=dkv_cache does not run with --decoding=eb and "
       "--cache=dual"),
      (dict(decoding="klass", cache="prefix", policy="sparse_dllm"), "--policy=sparse_dllm does not run with "
       "--decoding=klass and --cache=prefix"),
  ]:
    with pytest.raises(SessionError, match=message) as info:
      decoding_mode.from_values(**kwargs)
    assert "\n" not in str(info.value)
  with pytest.raises(SessionError, match="keeps a KV cache"):
    decoding_mode.from_values("klass", cache="prefix").check_guidance(1.0)
  from experiments.common.cli import UserError
  from experiments.lm_eval import args
  assert args.parse({"checkpoint": "tiny-dlm", "decoding": "eb", "cache": "prefix"}).mode.option_fields("llada") == {
      "rule": dr.EBSampler(), "cache": "prefix"}
  with pytest.raises(UserError, match="model_args decoding=wino: --decoding=wino does not run with --cache=dual"):
    args.parse({"checkpoint": "tiny-dlm", "decoding": "wino", "cache": "dual"})


def test_a_policy_with_a_rule_and_a_cache_is_refused_before_compiling():
  """The rules' cached calls are their own; sparse_dllm, which composes with the Fast-dLLM modes' caches, is
  refused with them too (a PolicyError raised while binding, before any model work)."""
  from dlm_jax.policy.base import PolicyError
  from dlm_jax.policy.registry import parse_policy
  options = llada.LLaDAOptions(gen_length=16, steps=16, block_length=8, rule=dr.KLASS(), cache="dual")
  prompt = np.full((1, LP), 3, np.int32)
  with pytest.raises(PolicyError, match="does not run with a decoding rule and cache='dual'") as info:
    llada.generate(rules.params(), prompt, config=rules.CONFIG, options=options,
                   setup=RunSetup(policy=parse_policy("sparse_dllm")))
  assert "\n" not in str(info.value)


def test_generate_binary_runs_a_rule_with_a_cache(tmp_path):
  from tests.experiments_fixtures import run_cases
  common = ["--checkpoint=tiny-dlm", "--prompt=Anna has 16 books.", "--gen_length=16", "--steps=16",
            "--block_length=8"]
  (ok, _), (bad, err), (truncated, _), (windowed, _) = run_cases("generate", [
      common + ["--decoding=klass", "--cache=dual", f"--json_out={tmp_path / 'klass.json'}"],
      common + ["--decoding=wino", "--cache=prefix", f"--json_out={tmp_path / 'wino.json'}"],
      common + ["--decoding=threshold", "--window=2", "--eos_truncation", f"--json_out={tmp_path / 'eos.json'}"],
      common + ["--decoding=threshold", "--window=2", f"--json_out={tmp_path / 'window.json'}"]])
  assert ok == 0 and (tmp_path / "klass.json").exists()
  assert bad != 0 and "--decoding=wino does not run with --cache=prefix" in err
  # Elastic-Cache's decoding flags (`DecodingMode.window` / `eos_truncation`) reach the sampler
  assert truncated == windowed == 0
  result = json.loads((tmp_path / "eos.json").read_text())
  assert {k: result["settings"]["decoding"][k] for k in ("window", "eos_truncation")} == {
      "window": 2, "eos_truncation": True}
  result = json.loads((tmp_path / "window.json").read_text())
  assert result["settings"]["decoding"]["window"] == 2
  assert result["nfe"] >= 16 // 2  # a call decodes at most the window's first 2 masks
