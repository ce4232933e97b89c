"""KLASS on Dream follows KLASS's Dream code by default (variant "dream_klass"; shkim0116/KLASS
`src/model/dream_klass.py::_sample`, alg "klass", unmask_strategy "all"), against a whole-run float64 NumPy replay
of that loop written here: the whole generation as one block, the KL history over every step (zeros before the
first, eps 1e-12), ready = every KL < kl_threshold and p(x0) >= conf_threshold with no step gate, all ready
positions committed, else the one mask of highest `sample_tokens` confidence (after top-k), at most `steps` calls.
The replay calls the same model forward once per step (Dream's outputs shifted right by one). Temperature 0, tiny
random Dream, rows batched and each replayed alone: tokens, per-step commits, last commit step and NFE equal.
LLaDA's rule on Dream stays selectable (variant "llada_klass"; its replay is tests/test_decoding_rules.py's)."""

import jax
import numpy as np
import pytest

from dlm_jax.sampling import decoding_rules as dr, dream, llada
from dlm_jax.session import DecodeSettings, SessionError, decoding_mode, model_settings, sampler_options
from dlm_jax.session.checkpoint_bundle import Model

try:
  from tests import test_decoding_rules as rules
except ImportError:  # run from inside tests/
  import test_decoding_rules as rules

LP, GEN, MASK = rules.LP, rules.GEN, rules.MASK
RULE = dr.KLASS(conf_threshold=0.5, kl_threshold=0.5)
STEPS = 8


def dream_klass_original(prompt, rule, steps, top_k=None):
  """KLASS's Dream loop on one row (module docstring); top_k: the fallback's `sample_tokens` keeps the top_k
  logits, so its confidence is p(x0) renormalised over them."""
  r = rules.Replay(prompt)
  r.fell_back = []
  s = len(r.x)
  p_prev = np.zeros((s, rules.DREAM.vocab_size))
  history = np.zeros((s, rule.kl_history_length))
  for _ in range(steps):
    mask_index = r.x == MASK
    if not mask_index.any():
      break
    p = rules.softmax(rules.model_logits(r.x))
    x0, conf, history = rules.klass_observe(p, p_prev, history)
    p_prev = p
    ready = np.nonzero(np.all(history < rule.kl_threshold, -1) & (conf >= rule.conf_threshold) & mask_index)[0]
    r.fell_back.append(len(ready) == 0)
    if len(ready) == 0:
      ranking = conf if top_k is None else conf / np.sort(p, -1)[:, -top_k:].sum(-1)
      ready = [int(np.argmax(np.where(mask_index, ranking, -np.inf)))]
    r.commit(ready, x0[ready])
  return r


def replay(batch, **kwargs):
  rules.MODEL["dream"] = True
  try:
    return [dream_klass_original(row, **kwargs) for row in batch]
  finally:
    rules.MODEL["dream"] = False


def check(trace, refs):
  for row, ref in enumerate(refs):
    rules._check_row(trace, row, ref)  # pylint: disable=protected-access
  assert int(trace.nfe) == max(len(ref.committed) for ref in refs)


@pytest.fixture(scope="module")
def batch():
  return rules.prompts(3, seed=3)


@pytest.fixture(scope="module")
def default_trace(batch):
  """KLASS with no variant on Dream: the Dream code."""
  return dream.diffusion_generate(rules.dream_params(), batch, config=rules.DREAM,
                                  options=dream.DreamOptions(gen_length=GEN, steps=STEPS, rule=RULE))


def test_dream_klass_is_the_default_and_matches_the_replay(batch, default_trace):
  refs = replay(batch, rule=RULE, steps=STEPS)
  check(default_trace, refs)
  commits = [int(np.sum(c)) for ref in refs for c in ref.committed]
  assert max(commits) > 1, "no step committed ready tokens in parallel"
  assert any(any(ref.fell_back) for ref in refs), "no step fell back to one token"
  assert any(len(ref.committed) < STEPS for ref in refs), "no row finished before its steps ran out"
  assert any((ref.x[LP:] == MASK).any() for ref in refs), "no row ran out of steps with masks left"
  first_ready = [j for ref in refs for j, c in enumerate(ref.committed) if np.sum(c) > 1]
  assert min(first_ready) == RULE.kl_history_length, "the zero-filled history did not hold back the first calls"
  rules.MODEL["dream"] = True  # KLASS's LLaDA code on the same outputs (one block) decodes otherwise
  try:
    other = [rules.klass_original(row, RULE, STEPS, GEN) for row in batch]
  finally:
    rules.MODEL["dream"] = False
  assert any(not np.array_equal(a.x, b.x) or len(a.committed) != len(b.committed) for a, b in zip(refs, other))


def test_dream_klass_ranks_its_fallback_after_top_k(batch, default_trace):
  """With top_k=1 every `sample_tokens` confidence is 1, so the fallback takes the first mask."""
  options = dream.DreamOptions(gen_length=GEN, steps=STEPS, rule=dr.KLASS(conf_threshold=0.5, kl_threshold=0.5,
                                                                          variant="dream_klass"), top_k=1)
  trace = dream.diffusion_generate(rules.dream_params(), batch, config=rules.DREAM, options=options)
  refs = replay(batch, rule=RULE, steps=STEPS, top_k=1)
  check(trace, refs)
  assert not np.array_equal(np.asarray(trace.committed), np.asarray(default_trace.committed))


def test_dream_klass_at_temperature_commits_argmax_tokens(batch):
  """At temperature > 0 the Dream code samples only its fallback's ranking: every committed token is the argmax
  of the outputs of the step that committed it, and a row decodes alike alone and batched (per-row keys)."""
  options = dream.DreamOptions(gen_length=GEN, steps=2 * GEN, rule=RULE, temperature=1.0)  # steps > G: <= G calls
  keys = jax.random.split(jax.random.key(5), len(batch))
  trace = dream.diffusion_generate(rules.dream_params(), batch, config=rules.DREAM, options=options, key=keys)
  rules.MODEL["dream"] = True
  try:
    for row in range(len(batch)):
      final = np.asarray(trace.tokens[row, LP:])
      for i in np.nonzero(np.asarray(trace.active_rows[:, row]))[0]:
        committed = np.asarray(trace.committed[i, row])
        argmax = rules.model_logits(np.concatenate([batch[row], np.asarray(trace.canvases[i, row])]))[LP:].argmax(-1)
        np.testing.assert_array_equal(final[committed], argmax[committed])
  finally:
    rules.MODEL["dream"] = False
  assert not np.any(np.asarray(trace.tokens[:, LP:]) == MASK)
  alone = dream.diffusion_generate(rules.dream_params(), batch[1:2], config=rules.DREAM, options=options,
                                   key=keys[1:2])
  np.testing.assert_array_equal(np.asarray(alone.tokens[0]), np.asarray(trace.tokens[1]))


@pytest.mark.parametrize("make, message", [
    (lambda: dr.KLASS(variant="dream"), "klass variant must be one of llada_klass, dream_klass"),
    (lambda: llada.LLaDAOptions(gen_length=16, steps=16, block_length=8, rule=dr.KLASS(variant="dream_klass")),
     "klass variant 'dream_klass' is KLASS's Dream code and runs on Dream only"),
    (lambda: dream.DreamOptions(gen_length=16, steps=16, block_length=8, rule=dr.KLASS()),
     "decodes the whole generation as one block; got block_length=8"),
    (lambda: dream.DreamOptions(gen_length=16, steps=16, rule=dr.KLASS(), cache="dual"),
     "klass variant 'dream_klass' has no blocks"),
    (lambda: dream.DreamOptions(gen_length=16, steps=16, block_length=8, rule=dr.KLASS(variant="llada_klass"),
                                temperature=0.5), "decoding rule klass cannot be combined with temperature > 0"),
])
def test_refused_in_one_line(make, message):
  with pytest.raises(ValueError, match=message) as info:
    make()
  assert "\n" not in str(info.value)


def test_variant_by_name_in_modes_flags_and_model_args():
  """The variant reaches the options from a spec, the binaries' flags' flat names and lm-eval's model_args;
  Dream's analysis defaults give dream_klass one block, llada_klass the default blocks."""
  from experiments.common.cli import UserError
  from experiments.lm_eval import args
  mode = decoding_mode.from_spec("klass:variant=llada_klass")
  assert mode.option_fields("dream") == {"rule": dr.KLASS(variant="llada_klass")}
  assert decoding_mode.DecodingMode.from_record(mode.record()) == mode
  assert decoding_mode.rule_knobs("klass", {"klass_variant": None, "klass_kl_history_length": 3}) == (
      ("kl_history_length", 3),)
  parsed = args.parse({"checkpoint": "tiny-dlm", "sampler": "dream", "decoding": "klass",
                       "klass_variant": "llada_klass"}).mode
  assert parsed.option_fields("dream") == {"rule": dr.KLASS(variant="llada_klass")}
  with pytest.raises(UserError, match="model_args decoding=klass: --decoding=klass: klass variant must be one of"):
    args.parse({"checkpoint": "tiny-dlm", "decoding": "klass", "klass_variant": "dream"})
  with pytest.raises(SessionError, match="--decoding=klass: klass variant must be one of") as info:
    decoding_mode.from_spec("klass:variant=llada")
  assert "\n" not in str(info.value)
  assert decoding_mode.from_values("klass").whole_generation("dream")
  assert not decoding_mode.from_values("klass").whole_generation("llada")
  model = Model("tiny-dream", "", rules.DREAM, None, None, {}, "dream", "plain")
  dream_klass = model_settings(DecodeSettings(gen_length=16, steps=16), model, decoding_mode.from_values("klass"))
  assert sampler_options.from_values(dream_klass, rules.DREAM) == dream.DreamOptions(
      gen_length=16, steps=16, alg="entropy", rule=dr.KLASS())
  llada_klass = model_settings(DecodeSettings(gen_length=16, steps=16), model, mode)
  assert sampler_options.from_values(llada_klass, rules.DREAM).block_length == 4
  with pytest.raises(SessionError, match="tiny-dream: --decoding=klass: klass variant 'dream_klass'.*block_length=8"):
    model_settings(DecodeSettings(gen_length=16, steps=16, block_length=8), model, decoding_mode.from_values("klass"))


def test_binaries_take_the_variant_and_refuse_it_on_llada(tmp_path):
  from tests.experiments_fixtures import run_cases
  common = ["--checkpoint=tiny-dlm", "--prompt=Anna has 16 books.", "--gen_length=16", "--steps=16",
            "--block_length=8", "--decoding=klass"]
  (bad_value, value_err), (wrong_family, family_err) = run_cases("generate", [
      common + ["--klass_variant=dream", f"--json_out={tmp_path / 'a.json'}"],
      common + ["--klass_variant=dream_klass", f"--json_out={tmp_path / 'b.json'}"]])
  assert bad_value != 0 and "klass_variant" in value_err
  assert wrong_family != 0 and "runs on Dream only" in family_err
