"""The decoding rules (EB-Sampler, KLASS, WINO, PC-Sampler, certainty prior) in the compiled LLaDA loop
against step-by-step Python replays of each rule's original loop, written here from the original code's
behaviour (NEUIR/PC-Sampler `generate_with_eb_sampler` / `generate_with_pc_sampler`, shkim0116/KLASS
`stable_confident_decode`, WINO's `decoding_wino`, Research dLLM's `vanilla` step with `sigma` and its
FFT `certainty_density`); the replays call the same model forward once per step. Temperature 0, tiny random
LLaDA, each row of a batch replayed alone: tokens, per-step commits and re-masks, last commit step and NFE
must be equal. Ties are broken by the lowest index in both (the originals' torch.topk leaves them open)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlm_jax import model
from dlm_jax.config import preset
from dlm_jax.model.attention import MASK_VALUE, AttentionBias
from dlm_jax.sampling import corpus_prior, decoding_rules as dr, dream, llada
from dlm_jax.session import SessionError, decoding_mode
from dlm_jax.sampling.run_setup import RunSetup

jax.config.update("jax_default_matmul_precision", "highest")

CONFIG = preset("tiny-llada")
DREAM = preset("tiny-dream")
MASK = CONFIG.mask_token_id
assert DREAM.mask_token_id == MASK and DREAM.vocab_size == CONFIG.vocab_size
LP, GEN = 5, 16


@functools.lru_cache(maxsize=None)
def params():
  """Random weights with a scaled LM head, so that proposals spread over confident and unsure."""
  p = model.init_params(CONFIG, jax.random.key(3))
  p["lm_head"]["kernel"] = p["lm_head"]["kernel"] * 9.0
  return p


@functools.lru_cache(maxsize=None)
def dream_params():
  p = model.init_params(DREAM, jax.random.key(4))
  p["lm_head"]["kernel"] = p["lm_head"]["kernel"] * 9.0
  return p


def prompts(batch=3, seed=0):
  return np.random.default_rng(seed).integers(3, 200, size=(batch, LP)).astype(np.int32)


@functools.lru_cache(maxsize=None)
def _forward(with_bias: bool, config=CONFIG):
  if with_bias:
    return jax.jit(lambda p, t, pos, bias: model.forward(p, t, config=config, positions=pos, bias=bias).logits)
  return jax.jit(lambda p, t: model.forward(p, t, config=config).logits)


MODEL = {"dream": False, "calls": None}
"""Which model the replays call: LLaDA's, or Dream's (outputs shifted right by one: position p reads the output
at p − 1, position 0 its own); "calls": None, or a function (tokens, block start) -> logits that replaces
`logits_of` (the KV-cache and CFG replays, tests/test_decoding_rules_cache.py)."""


def logits_of(tokens, lo=None):
  """The reference's model: the whole row [S] -> float64 logits [S, V] (the prediction for each position);
  lo: the first position of the step's block (read by MODEL["calls"] only)."""
  if MODEL["calls"] is not None:
    return MODEL["calls"](tokens, lo)
  return model_logits(tokens)


def model_logits(tokens):
  """`logits_of` of the model itself (LLaDA's or Dream's, MODEL["dream"])."""
  if not MODEL["dream"]:
    return np.asarray(_forward(False)(params(), jnp.asarray(tokens[None])), np.float64)[0]
  out = np.asarray(_forward(False, DREAM)(dream_params(), jnp.asarray(tokens[None])), np.float64)[0]
  return np.concatenate([out[:1], out[:-1]])


def logits_with_copy(x_block, positions, bias):
  """The reference's WINO call: [S + B] tokens and positions under the copy's bias -> float64 logits [S + B, V].
  Dream: the outputs shifted right by one over the whole S + B row (Research dLLM's
  `prepare_logits_for_generation` on its `wino.py` call), so copy position j reads the output at S + j − 1."""
  inputs = (jnp.asarray(x_block[None]), jnp.asarray(positions[None]), bias)
  if not MODEL["dream"]:
    return np.asarray(_forward(True)(params(), *inputs), np.float64)[0]
  out = np.asarray(_forward(True, DREAM)(dream_params(), *inputs), np.float64)[0]
  return np.concatenate([out[:1], out[:-1]])


def softmax(z):
  z = z - z.max(-1, keepdims=True)
  e = np.exp(z)
  return e / e.sum(-1, keepdims=True)


def klass_observe(p, p_prev, history):
  """One call of KLASS's originals (its LLaDA and Dream code alike): x0 = argmax of p [S, V], its probability,
  and the KL history [S, h] shifted left with KL(p‖p_prev) (eps 1e-12) appended."""
  x0 = p.argmax(-1)
  kl = (p * (np.log(p + 1e-12) - np.log(p_prev + 1e-12))).sum(-1)
  history = np.roll(history, -1, axis=-1)
  history[:, -1] = kl
  return x0, p[np.arange(len(p)), x0], history


def top(scores, k):
  """Indices of the k largest scores, lowest index first among equals."""
  return np.argsort(-scores, kind="stable")[:k]


def quota(n, steps):
  base, rem = divmod(n, steps)
  return [base + (j < rem) for j in range(steps)]


class Replay:
  """A row's decoding record: tokens, commits and re-masks per step."""

  def __init__(self, prompt):
    self.x = np.concatenate([prompt, np.full(GEN, MASK, np.int64)])
    self.committed, self.revoked, self.read = [], [], []

  def commit(self, positions, tokens, revoked=()):
    self.read.append(self.x[LP:].copy())
    c = np.zeros(GEN, bool)
    r = np.zeros(GEN, bool)
    c[np.asarray(positions, int) - LP] = True
    r[np.asarray(revoked, int) - LP] = True
    self.x[np.asarray(positions, int)] = tokens
    self.x[np.asarray(revoked, int)] = MASK
    self.committed.append(c)
    self.revoked.append(r)


# ------------------------------------------------------------------------------------- the originals


def eb_original(prompt, gamma, block):
  r = Replay(prompt)
  for b in range(GEN // block):
    lo, hi = LP + b * block, LP + (b + 1) * block
    while (r.x[lo:hi] == MASK).any():
      logits = logits_of(r.x, lo)
      masked = np.nonzero(r.x[lo:hi] == MASK)[0] + lo
      p = softmax(logits[masked])
      h = -(p * np.log(np.maximum(p, 1e-300))).sum(-1)
      order = np.argsort(h, kind="stable")
      acc, peak = np.cumsum(h[order]), np.maximum.accumulate(h[order])
      k = int(np.clip((acc - peak <= gamma).sum(), 1, len(masked)))
      chosen = masked[order[:k]]
      r.commit(chosen, logits[chosen].argmax(-1))
  return r


def klass_original(prompt, rule, steps_per_block, block, top_k=None):
  """top_k: the fallback ranks by p(x0) renormalised over the top_k tokens (KLASS's Dream code: its fallback's
  `sample_tokens` with top-k at temperature 0)."""
  r = Replay(prompt)
  s = len(r.x)
  p_prev = np.zeros((s, CONFIG.vocab_size))
  history = np.zeros((s, rule.kl_history_length))
  for b in range(GEN // block):
    lo, hi = LP + b * block, LP + (b + 1) * block
    schedule = quota(int((r.x[lo:hi] == MASK).sum()), steps_per_block)
    for step in range(steps_per_block):
      mask_index = np.zeros(s, bool)
      mask_index[lo:hi] = r.x[lo:hi] == MASK
      if not mask_index.any():
        break
      p = softmax(logits_of(r.x, lo))
      x0, conf, history = klass_observe(p, p_prev, history)
      p_prev = p
      stable = np.all(history < rule.kl_threshold, -1) if step >= rule.kl_history_length - 1 else np.zeros(s, bool)
      ready = np.nonzero(stable & (conf > rule.conf_threshold) & mask_index)[0]
      if len(ready) == 0:  # the original's topk can exceed the masks left and rewrite other positions; not us
        ranking = conf if top_k is None else conf / np.sort(p, -1)[:, -top_k:].sum(-1)
        ready = top(np.where(mask_index, ranking, -np.inf), min(schedule[step], int(mask_index.sum())))
      r.commit(ready, x0[ready])
  return r


def wino_original(prompt, rule, block):
  r = Replay(prompt)
  s = len(r.x)
  for b in range(GEN // block):
    lo, hi = LP + b * block, LP + (b + 1) * block
    x_block = np.concatenate([r.x, np.full(block, MASK)])
    positions = np.concatenate([np.arange(s), np.arange(lo, hi)])
    allowed = np.ones((s + block, s + block), bool)
    allowed[:, -block:] = False
    allowed[-block:, -block:] = True
    allowed[-block:, lo:hi] = ~np.eye(block, dtype=bool)
    bias = AttentionBias(pairwise=jnp.asarray(np.where(allowed, 0.0, MASK_VALUE), jnp.float32)[None, None])
    last_accept = 30
    while (r.x[lo:hi] == MASK).any():
      x_block[:s] = r.x
      mask_index = np.zeros(s, bool)
      mask_index[lo:hi] = r.x[lo:hi] == MASK
      max_accept = min(max(int(mask_index.sum() * 0.7), 5), 20)
      logits = logits_with_copy(x_block, positions, bias)
      p = softmax(logits)
      x0 = logits[:s].argmax(-1)
      conf = np.where(mask_index, p[np.arange(s), x0], -np.inf)
      decoded = np.zeros(s, bool)
      decoded[lo:hi] = r.x[lo:hi] != MASK
      back = np.full(s, np.inf)
      back[lo:hi] = np.where(decoded[lo:hi], p[s + np.arange(block), r.x[lo:hi]], np.inf)
      transfer = np.nonzero(conf > rule.wide_in)[0]
      if len(transfer) > max_accept:
        transfer = top(conf, max_accept)
      elif len(transfer) == 0:
        transfer = top(conf, 1)
      remask = np.array([], int)
      if len(transfer) > 1:
        remask = np.nonzero(back < rule.narrow_out)[0]
        if len(remask) >= last_accept:
          remask = top(-back, last_accept - 1)
      r.commit(transfer, x0[transfer], remask)
      last_accept = len(transfer)
  return r


def pc_original(prompt, rule, frequencies, steps_per_block, block):
  r = Replay(prompt)
  for b in range(GEN // block):
    lo, hi = LP + b * block, LP + (b + 1) * block
    schedule = quota(int((r.x[lo:hi] == MASK).sum()), steps_per_block)
    for step in range(steps_per_block):
      logits = logits_of(r.x, lo)[lo:hi].astype(np.float32)
      p = softmax(logits)
      x0 = p.argmax(-1)
      conf = p[np.arange(block), x0]
      score = np.exp(-rule.lam * np.arange(block, dtype=np.float32)) * np.minimum(
          -conf * np.log(frequencies[x0] + 1e-9), rule.alpha)
      score = np.where(r.x[lo:hi] == MASK, score, -np.inf)
      chosen = top(score, schedule[step])
      r.commit(chosen + lo, x0[chosen])
  return r


def fft_density(decoded, sigma):
  """Research dLLM's certainty_density, by FFT as the original computes it."""
  g = len(decoded)
  padded = np.concatenate([np.ones(g), decoded.astype(np.float64), np.full(g, 1.0 if decoded[-1] else 0.0)])
  ext = 3 * g
  dist = np.concatenate([np.arange(ext), np.arange(-ext, 0)])
  kernel = np.fft.fft(np.exp(-dist ** 2 / (2 * sigma ** 2)), n=2 * ext)
  weighted = np.fft.ifft(np.fft.fft(np.concatenate([padded, np.zeros(ext)]), n=2 * ext) * kernel).real
  norm = np.fft.ifft(np.fft.fft(np.ones(2 * ext), n=2 * ext) * kernel).real
  return weighted[g:2 * g] / np.maximum(norm[g:2 * g], 1e-8)


def certainty_original(prompt, rule, steps_per_block, block):
  r = Replay(prompt)
  for b in range(GEN // block):
    lo, hi = LP + b * block, LP + (b + 1) * block
    schedule = quota(block, steps_per_block)
    for step in range(steps_per_block):
      if not (r.x[lo:hi] == MASK).any():
        break
      logits = logits_of(r.x, lo)[LP:]
      p = softmax(logits)
      x0 = p.argmax(-1)
      gen = r.x[LP:]
      conf = np.where(gen == MASK, p[np.arange(GEN), x0], -np.inf)
      scores = conf * fft_density(gen != MASK, rule.sigma)
      in_block = np.zeros(GEN, bool)
      in_block[lo - LP:hi - LP] = True
      candidates = in_block & (gen == MASK)
      chosen = top(np.where(candidates, scores, -np.inf), min(int(candidates.sum()), schedule[step]))
      r.commit(chosen + LP, x0[chosen])
  return r


# ------------------------------------------------------------------------------------- the comparisons


def prior():
  rng = np.random.default_rng(5)
  vocab = {f"t{i}": i for i in range(CONFIG.vocab_size)}
  corpus = [rng.zipf(1.3, size=40) % CONFIG.vocab_size for _ in range(20)]
  return corpus_prior.from_document(corpus_prior.count(corpus, vocab))


PC_PRIOR = prior()

CASES = {
    "eb_one_block": (dr.EBSampler(gamma=0.5), dict(block_length=16, steps=16),
                     lambda p: eb_original(p, 0.5, 16)),
    "eb_blocks": (dr.EBSampler(gamma=0.5), dict(block_length=8, steps=16), lambda p: eb_original(p, 0.5, 8)),
    "klass": (dr.KLASS(conf_threshold=0.3, kl_threshold=1.0, kl_history_length=2), dict(block_length=8, steps=8),
              lambda p: klass_original(p, dr.KLASS(conf_threshold=0.3, kl_threshold=1.0), 4, 8)),
    "wino": (dr.WINO(wide_in=0.3, narrow_out=0.95), dict(block_length=8, steps=16),
             lambda p: wino_original(p, dr.WINO(wide_in=0.3, narrow_out=0.95), 8)),
    "pc": (dr.PCSampler(prior=PC_PRIOR), dict(block_length=8, steps=8),
           lambda p: pc_original(p, dr.PCSampler(prior=PC_PRIOR), PC_PRIOR.frequencies, 4, 8)),
    "certainty_prior": (dr.CertaintyPrior(sigma=3.0), dict(block_length=16, steps=8),
                        lambda p: certainty_original(p, dr.CertaintyPrior(sigma=3.0), 8, 16)),
}


DREAM_CASES = ("eb_blocks", "klass", "wino", "pc", "certainty_prior")
"""The cases Dream runs too (WINO with Research dLLM's shifted read of the copy, `logits_with_copy`)."""


def _check_row(trace, row, ref: Replay):
  nfe = len(ref.committed)
  np.testing.assert_array_equal(np.asarray(trace.tokens[row]), ref.x)
  assert int(trace.row_nfe[row]) == nfe
  active = np.asarray(trace.active_rows[:, row])
  np.testing.assert_array_equal(np.asarray(trace.committed[:, row])[active], np.stack(ref.committed))
  np.testing.assert_array_equal(np.asarray(trace.revoked[:, row])[active], np.stack(ref.revoked))
  np.testing.assert_array_equal(np.asarray(trace.canvases[:, row])[active], np.stack(ref.read))
  last = np.full(GEN, -1)
  own_steps = np.nonzero(active)[0]
  for j, (c, r) in enumerate(zip(ref.committed, ref.revoked)):
    last[c] = own_steps[j]
    last[r] = -1
  np.testing.assert_array_equal(np.asarray(trace.decode_step[row]), last)


@pytest.mark.parametrize("case", sorted(CASES))
def test_rule_matches_original_replay(case):
  rule, layout, original = CASES[case]
  batch = prompts()
  trace = llada.generate(params(), batch, config=CONFIG,
                         options=llada.LLaDAOptions(gen_length=GEN, rule=rule, **layout))
  refs = [original(row) for row in batch]
  for row, ref in enumerate(refs):
    _check_row(trace, row, ref)
  assert int(trace.nfe) == max(len(ref.committed) for ref in refs)
  parallel = max(int(np.sum(c)) for ref in refs for c in ref.committed)
  assert parallel > 1 or case.startswith("pc") or case == "certainty_prior", "the case never commits in parallel"
  if case == "klass":
    assert min(len(ref.committed) for ref in refs) < 8, "no KLASS block ended early on ready tokens"
    assert any((ref.x[LP:] == MASK).any() for ref in refs), "no KLASS block was left with masks"
  if case == "wino":
    assert sum(int(np.sum(r)) for ref in refs for r in ref.revoked) > 0, "the WINO case never re-masks"
    assert int(jnp.max(trace.revocations)) >= 1
    first = np.asarray(trace.first_commit_step)
    assert np.all((first <= np.asarray(trace.decode_step)) | (first == -1))


@pytest.mark.parametrize("case", DREAM_CASES)
def test_dream_rule_matches_original_replay(case):
  rule, layout, original = CASES[case]
  if case == "klass":  # LLaDA's KLASS code on Dream, by name (Dream's own is tests/test_dream_klass.py's)
    rule = dataclasses.replace(rule, variant="llada_klass")
  batch = prompts(2, seed=2)
  trace = dream.diffusion_generate(dream_params(), batch, config=DREAM,
                                   options=dream.DreamOptions(gen_length=GEN, rule=rule, **layout))
  MODEL["dream"] = True
  try:
    refs = [original(row) for row in batch]
  finally:
    MODEL["dream"] = False
  for row, ref in enumerate(refs):
    _check_row(trace, row, ref)
  assert int(trace.nfe) == max(len(ref.committed) for ref in refs)
  if case == "wino":
    assert sum(int(np.sum(r)) for ref in refs for r in ref.revoked) > 0, "the Dream WINO case never re-masks"
    assert max(int(np.sum(c)) for ref in refs for c in ref.committed) > 1, "the Dream WINO case never drafts wide"


def test_wino_python_loop_equals_compiled():
  rule, layout, _ = CASES["wino"]
  options = llada.LLaDAOptions(gen_length=GEN, rule=rule, **layout)
  batch = prompts(2, seed=1)
  compiled = llada.generate(params(), batch, config=CONFIG, options=options)
  python = llada.generate(params(), batch, config=CONFIG, options=options, setup=RunSetup(loop="python"))
  for field in ("tokens", "decode_step", "nfe", "committed", "revoked", "active_rows"):
    np.testing.assert_array_equal(np.asarray(getattr(compiled, field)), np.asarray(getattr(python, field)))


@pytest.mark.parametrize("make, message", [
    (lambda: dr.EBSampler(gamma=-1.0), "eb gamma must be a number >= 0"),
    (lambda: dr.KLASS(kl_history_length=0), "klass kl_history_length must be an integer >= 1"),
    (lambda: dr.KLASS(conf_threshold=1.5), "klass conf_threshold must be a probability"),
    (lambda: dr.KLASS(kl_threshold=0.0), "klass kl_threshold must be a number > 0"),
    (lambda: dr.WINO(wide_in=2.0), "wino wide_in must be a probability"),
    (lambda: dr.PCSampler(), "pc needs a corpus prior"),
    (lambda: dr.PCSampler(prior=PC_PRIOR, alpha=0.0), "pc alpha must be a number > 0"),
    (lambda: dr.CertaintyPrior(sigma=0.0), "certainty_prior sigma must be a number > 0"),
    (lambda: llada.LLaDAOptions(gen_length=16, steps=16, block_length=16, rule=dr.WINO(), temperature=0.5),
     "decoding rule wino cannot be combined with temperature > 0"),
    (lambda: llada.LLaDAOptions(gen_length=16, steps=16, block_length=16, rule=dr.EBSampler(), threshold=0.9),
     "decoding rule eb cannot be combined with threshold"),
    (lambda: llada.LLaDAOptions(gen_length=16, steps=32, block_length=16, rule=dr.CertaintyPrior()),
     "takes at most block_length steps per block"),
])
def test_bad_knobs_refused_in_one_line(make, message):
  with pytest.raises(ValueError, match=message) as info:
    make()
  assert "\n" not in str(info.value)


def test_prior_of_another_vocabulary_refused_before_compiling():
  vocab = {f"t{i}": i for i in range(100)}
  small = corpus_prior.from_document(corpus_prior.count([[1, 2, 3]], vocab))
  options = llada.LLaDAOptions(gen_length=16, steps=16, block_length=16, rule=dr.PCSampler(prior=small))
  with pytest.raises(ValueError, match="pc prior is for a vocabulary of 100 ids, the model has 256"):
    llada.generate(params(), prompts(1), config=CONFIG, options=options)


def test_prior_file_checks(tmp_path):
  vocab = {f"t{i}": i for i in range(CONFIG.vocab_size)}
  document = corpus_prior.count([[4, 4, 5], [6]], vocab)
  path = str(tmp_path / "prior.json")
  corpus_prior.save(document, path)
  loaded = corpus_prior.load(path, vocab=vocab, vocab_size=CONFIG.vocab_size)
  assert loaded.frequencies[4] == pytest.approx(0.5) and loaded.frequencies[7] == pytest.approx(0.25)
  other = {f"u{i}": i for i in range(CONFIG.vocab_size)}
  with pytest.raises(ValueError, match="made for another tokenizer"):
    corpus_prior.load(path, vocab=other)
  with pytest.raises(ValueError, match="no such file"):
    corpus_prior.load(str(tmp_path / "missing.json"))
  text = open(path).read()
  (tmp_path / "torn.json").write_text(text[: len(text) // 2])
  with pytest.raises(ValueError, match="torn"):
    corpus_prior.load(str(tmp_path / "torn.json"))
  (tmp_path / "edited.json").write_text(text.replace('"4": 2', '"4": 3'))
  with pytest.raises(ValueError, match="torn or was edited"):
    corpus_prior.load(str(tmp_path / "edited.json"))


def test_binary_modes_build_the_rules(tmp_path):
  mode = decoding_mode.from_spec("eb:gamma=0.1")
  assert mode.record() == {"decoding": "eb", "knobs": {"gamma": 0.1}}
  assert decoding_mode.DecodingMode.from_record(mode.record()) == mode
  assert mode.option_fields("llada") == {"rule": dr.EBSampler(gamma=0.1)}
  assert decoding_mode.from_values("klass", knobs=(("kl_history_length", 3),)).option_fields("mmada") == {
      "rule": dr.KLASS(kl_history_length=3)}
  with pytest.raises(SessionError, match="the block_diffusion sampler has no wino decoding yet"):
    decoding_mode.from_values("wino").option_fields("block_diffusion")
  assert dream.DreamOptions(gen_length=16, steps=16, **decoding_mode.from_values("wino").option_fields("dream")
                            ).rule == dr.WINO()
  with pytest.raises(ValueError, match="decoding rule wino cannot be combined with temperature > 0"):
    dream.DreamOptions(gen_length=16, steps=16, rule=dr.WINO(), temperature=0.5)
  with pytest.raises(ValueError, match="decoding rule wino cannot be combined with top_p or top_k"):
    dream.DreamOptions(gen_length=16, steps=16, rule=dr.WINO(), top_p=0.9)
  with pytest.raises(SessionError, match=r"--decoding=wino: wino narrow_out must be a probability"):
    decoding_mode.from_spec("wino:narrow_out=1.5")
  with pytest.raises(SessionError, match="--decoding=eb: decoding rule eb has no knob sigma"):
    decoding_mode.from_spec("eb:sigma=1")
  vocab = {f"t{i}": i for i in range(CONFIG.vocab_size)}
  path = str(tmp_path / "prior.json")
  corpus_prior.save(corpus_prior.count([[4, 5]], vocab), path)
  mode = decoding_mode.from_spec(f"pc:prior={path}")
  assert mode.option_fields("llada")["rule"].prior.num_tokens == 2

  class Other:
    class backend:  # pylint: disable=invalid-name
      @staticmethod
      def get_vocab(with_added_tokens):
        del with_added_tokens
        return {f"u{i}": i for i in range(CONFIG.vocab_size)}

  with pytest.raises(SessionError, match="--decoding=pc: pc prior .* made for another tokenizer") as info:
    mode.check_tokenizer(Other())
  assert "\n" not in str(info.value)


def test_lm_eval_model_args_take_the_rules():
  from experiments.common.cli import UserError
  from experiments.lm_eval import args
  mode = args.parse({"checkpoint": "tiny-dlm", "decoding": "klass", "klass_kl_history_length": "3",
                     "eb_gamma": "0.5"}).mode
  assert mode.option_fields("llada") == {"rule": dr.KLASS(kl_history_length=3)}
  assert args.parse({"checkpoint": "tiny-dlm", "decoding": "eb", "eb_gamma": "0.5"}).mode.knobs == (("gamma", 0.5),)
  assert args.parse({"checkpoint": "tiny-dlm", "sampler": "dream", "decoding": "wino", "wino_narrow_out": "0.95"}
                    ).mode.option_fields("dream") == {"rule": dr.WINO(narrow_out=0.95)}
  with pytest.raises(UserError, match="model_args decoding=wino: --decoding=wino: wino wide_in must be a "
                                      "probability") as info:
    args.parse({"checkpoint": "tiny-dlm", "decoding": "wino", "wino_wide_in": "7"})
  assert "\n" not in str(info.value)
  with pytest.raises(UserError, match="pc needs a corpus prior"):
    args.parse({"checkpoint": "tiny-dlm", "decoding": "pc"})


def test_rules_read_probabilities_whatever_the_ranking_and_wino_statistics_cover_the_sequence():
  from dlm_jax.instrument.stats import StatsSpec
  rule, layout, _ = CASES["wino"]
  batch = prompts(1, seed=3)
  plain = llada.generate(params(), batch, config=CONFIG, options=llada.LLaDAOptions(gen_length=GEN, rule=rule,
                                                                                    **layout))
  traced = llada.generate(params(), batch, config=CONFIG, stats_spec=StatsSpec(incoming_attention=True),
                          sink_top_k=2, options=llada.LLaDAOptions(gen_length=GEN, rule=rule,
                                                                   confidence_ranking="log_odds", **layout))
  np.testing.assert_array_equal(np.asarray(plain.tokens), np.asarray(traced.tokens))
  np.testing.assert_array_equal(np.asarray(plain.committed), np.asarray(traced.committed))
  s = LP + GEN
  assert traced.stats["incoming_attention"].shape[-1] == s and int(jnp.max(traced.top_sinks)) < s
  rule, layout, original = CASES["pc"]
  trace = llada.generate(params(), batch, config=CONFIG, options=llada.LLaDAOptions(
      gen_length=GEN, rule=rule, confidence_ranking="log_odds", **layout))
  _check_row(trace, 0, original(batch[0]))


def test_dream_wino_statistics_and_padding():
  """Dream WINO with statistics and a left-padded row (Dream's outer padding, extended over the copy): the full
  row equals its replay, the padded row equals its unpadded prompt alone, statistics cover the S keys."""
  from dlm_jax.instrument.stats import StatsSpec
  rule, layout, original = CASES["wino"]
  batch = prompts(2, seed=5)
  short = batch[1, 1:].copy()
  batch[1, 0] = 0
  options = dream.DreamOptions(gen_length=GEN, rule=rule, **layout)
  traced = dream.diffusion_generate(dream_params(), batch, config=DREAM, options=options,
                                    prompt_mask=np.array([[1] * LP, [0] + [1] * (LP - 1)], np.int32),
                                    setup=RunSetup(sink_top_k=2, stats_spec=StatsSpec(incoming_attention=True)))
  MODEL["dream"] = True
  try:
    _check_row(traced, 0, original(batch[0]))
  finally:
    MODEL["dream"] = False
  alone = dream.diffusion_generate(dream_params(), short[None], config=DREAM, options=options)
  np.testing.assert_array_equal(np.asarray(traced.tokens[1, 1:]), np.asarray(alone.tokens[0]))
  steps = np.asarray(traced.active_rows[:, 1])
  for field in ("committed", "revoked"):
    np.testing.assert_array_equal(np.asarray(getattr(traced, field)[:, 1])[steps],
                                  np.asarray(getattr(alone, field)[:, 0])[np.asarray(alone.active_rows[:, 0])])
  assert int(traced.row_nfe[1]) == int(alone.nfe) and int(np.sum(np.asarray(alone.revoked))) > 0
  assert traced.stats["incoming_attention"].shape[-1] == LP + GEN and int(jnp.max(traced.top_sinks)) < LP + GEN


def test_explorer_marks_drafts_revoked_later_and_re_masks():
  """Position 3 drafted 'b' at step 10, re-masked at step 11, committed 'c' at step 12; position 2 kept its
  step-10 token: the explorer data marks 3 as a draft after step 10 and as re-masked at step 11 only."""
  from experiments.reports import explorer_page
  committed = np.zeros((3, 5), bool)
  revoked = np.zeros((3, 5), bool)
  committed[0, [2, 3]] = True
  revoked[1, 3] = True
  committed[2, 3] = True
  canvas = np.array([[0, 0, 9, 9, 9], [0, 0, 5, 6, 9], [0, 0, 5, 9, 9]])
  out = explorer_page._revisions(committed, revoked, np.array([-1, -1, 10, 12, -1]), canvas, np.array([10, 11, 12]),
                                 {5: "a", 6: "b", 9: "[MASK]"})
  assert out == {"revoked": [[], [3], []], "drafted": [[3], [], []], "draft_text": [["b"], [], []]}
