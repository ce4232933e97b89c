"""The per-step logit lens (`dlm_jax.analysis.logit_lens`) against a NumPy reference, and
`experiments.logit_lens` end to end.

Reference: each kept step's canvas is rebuilt from the final tokens and `Trace.decode_step`, a plain forward
returns each layer's raw residual (hook_resid_post, reduce "none"; conftest sets float32 matmuls at the
"highest" precision); the final norm, the LM head, the softmax,
the rank and the top-k are written here in NumPy, the embedding row is read from the params, and the last
row is also compared with the forward's own logits."""

import functools
import json

import jax
import numpy as np
import pytest

from dlm_jax import model
from dlm_jax.analysis import logit_lens
from dlm_jax.config import preset
from dlm_jax.instrument.hook_call import HookCall, hook_values
from dlm_jax.instrument.hook_spec import Capture, Hooks, Steps
from dlm_jax.sampling import autoregressive, llada
from dlm_jax.sampling.trace import Trace

try:
  from tests import experiments_fixtures as fx
except ImportError:
  import experiments_fixtures as fx

B, LP, K = 2, 6, 3


def _setup(name: str, seed: int):
  config = preset(name)
  params = model.init_params(config, jax.random.key(seed))
  weight = jax.random.uniform(jax.random.key(seed + 1), (config.d_model,), minval=0.3, maxval=2.0)
  params["final_norm"]["weight"] = weight  # a non-unit norm weight, as in a trained model
  prompt = jax.random.randint(jax.random.key(seed + 2), (B, LP), 4, 250)
  return config, params, np.asarray(prompt, np.int32)


def _reference(config, params, canvas: np.ndarray, targets: np.ndarray):
  """Lens of every row on canvas [B, S] read at targets [B, S]: probability, rank [R, B, S], top tokens and
  probabilities [R, B, S, K] in NumPy, and the forward's own p(target) of the last row."""
  raw = Hooks(captures=(Capture("hook_resid_post", reduce="none"),))
  out = model.forward(params, canvas, config=config,
                      hooks=HookCall(hooks=raw, values=hook_values(raw, config, *canvas.shape)))
  embedding = np.asarray(params["embed"]["embedding"], np.float64)
  residuals = [embedding[canvas]] + [np.asarray(out.captures[f"blocks.{l}.hook_resid_post"], np.float64)
                                     for l in range(config.n_layers)]
  weight = np.asarray(params["final_norm"]["weight"], np.float64)
  head = embedding.T if config.tied_embeddings else np.asarray(params["lm_head"]["kernel"], np.float64)
  probs = []
  for x in residuals:
    normed = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + config.norm_eps) * weight
    logits = normed @ head
    e = np.exp(logits - logits.max(-1, keepdims=True))
    probs.append(e / e.sum(-1, keepdims=True))
  probs = np.stack(probs)  # [R, B, S, V]
  target_p = np.take_along_axis(probs, np.broadcast_to(targets[None, ..., None], probs.shape[:-1] + (1,)), -1)[..., 0]
  rank = (probs > target_p[..., None]).sum(-1)
  top = np.argsort(-probs, axis=-1, kind="stable")[..., :K]
  own = jax.nn.softmax(np.asarray(out.logits, np.float64), -1)
  own_p = np.take_along_axis(np.asarray(own), targets[..., None], -1)[..., 0]
  return target_p, rank, top, np.take_along_axis(probs, top, -1), own_p


def _compare(lens, n, row_index, ref, positions):
  """The lens at kept slot n equals the reference at `positions` (sequence indices, per batch row)."""
  target_p, rank, top, top_p, own_p = ref
  for b, ps in enumerate(positions):
    got = lens.probability[n, :, b, ps]
    np.testing.assert_allclose(got, target_p[:, b, row_index(ps)].T, atol=1e-5, rtol=0)
    np.testing.assert_allclose(got[:, -1], own_p[b, row_index(ps)], atol=1e-5, rtol=0)
    np.testing.assert_array_equal(lens.rank[n, :, b, ps], rank[:, b, row_index(ps)].T)
    np.testing.assert_array_equal(lens.top_tokens[n, :, b, ps], np.moveaxis(top[:, b, row_index(ps)], 0, 1))
    np.testing.assert_allclose(lens.top_probabilities[n, :, b, ps], np.moveaxis(top_p[:, b, row_index(ps)], 0, 1),
                               atol=1e-5, rtol=0)


def _check_summaries(lens):
  sel = lens.selected[:, None]
  with np.errstate(invalid="ignore"):
    expected = (lens.probability * sel).sum(-1) / sel.sum(-1)
    top1 = ((lens.rank == 0) & sel).sum(-1) / sel.sum(-1)
  np.testing.assert_allclose(lens.mean_probability(), expected, rtol=1e-6)
  np.testing.assert_allclose(lens.top1_fraction(), top1, rtol=1e-6)
  first = lens.first_top1_row()
  n, b, p = np.argwhere(first >= 0)[0]
  assert lens.rank[n, first[n, b, p], b, p] == 0 and (lens.rank[n, :first[n, b, p], b, p] > 0).all()


def test_llada_lens_equals_numpy_reference():
  config, params, prompt = _setup("tiny-llada", 0)
  options = llada.LLaDAOptions(gen_length=8, steps=8, block_length=4)
  sample = functools.partial(llada.generate, params, prompt, config=config, options=options, key=jax.random.key(3))
  counted = np.ones((B, 8), bool)
  counted[1, 4:] = False
  lens = logit_lens.logit_lens(sample, config, steps=Steps.at_steps(0, 3, 6), k=K).only(counted)
  assert lens.steps.tolist() == [0, 3, 6] and lens.rows == ("embed", "0", "1")
  tokens = lens.tokens
  np.testing.assert_array_equal(tokens, np.asarray(sample().tokens))  # the lens run decodes the plain run's tokens
  decode_step = np.asarray(sample().decode_step)
  for n, step in enumerate(lens.steps):
    masked = decode_step >= step  # [B, G]: still holding the mask token at this call
    canvas = tokens.copy()
    canvas[:, LP:][masked] = config.mask_token_id
    positions = [LP + np.flatnonzero(masked[b] & counted[b]) for b in range(B)]
    for b in range(B):
      assert np.flatnonzero(lens.selected[n, b]).tolist() == positions[b].tolist()
    _compare(lens, n, lambda ps: ps, _reference(config, params, canvas, tokens), positions)
  assert lens.count.tolist() == [[8, 4], [5, 1], [2, 0]]
  _check_summaries(lens)
  assert np.isnan(lens.mean_probability()[2, :, 1]).all()


def test_autoregressive_lens_reads_the_fed_position():
  config, params, prompt = _setup("tiny-llama", 10)
  sample = functools.partial(autoregressive.generate, params, prompt, config=config,
                             options=autoregressive.AROptions(gen_length=5), key=jax.random.key(4))
  lens = logit_lens.logit_lens(sample, config, steps=Steps.every(2), k=K)
  assert lens.steps.tolist() == [0, 2, 4]
  tokens = lens.tokens
  # causal: one forward over the final tokens gives every fed position's residuals; query q predicts q + 1
  ref = _reference(config, params, tokens, logit_lens.lens_targets(tokens, 1))
  for n, step in enumerate(lens.steps):
    target = LP + step  # step i produces generated token i from the fed position Lp + i − 1
    assert [np.flatnonzero(lens.selected[n, b]).tolist() for b in range(B)] == [[target]] * B
    _compare(lens, n, lambda ps: ps - 1, ref, [np.asarray([target])] * B)
  assert (lens.rank[:, -1][lens.selected] == 0).all()  # greedy: the model's own top-1 is the token produced
  _check_summaries(lens)


def test_lens_refuses_a_sampler_that_decodes_other_tokens():
  config, _, _ = _setup("tiny-llada", 0)
  calls = []

  def flaky(hooks, hook_values):
    del hooks, hook_values
    calls.append(1)
    tokens = np.full((1, 4), len(calls), np.int32)
    return Trace(tokens=tokens, decode_step=np.zeros((1, 2), np.int32), nfe=np.int32(1), prompt_length=2)

  with pytest.raises(RuntimeError, match="other tokens"):
    logit_lens.logit_lens(flaky, config, k=2)
  with pytest.raises(ValueError, match="kind"):
    logit_lens.lens_hooks(config, Steps.decoded(), 2)


SMALL = ["--n_prompts=2", "--batch_size=2", "--gen_length=8", "--steps=8", "--block_length=4"]


def test_binary_end_to_end_resumes_and_refuses_bad_plans(tmp_path):
  out = tmp_path / "out"
  args = ["--checkpoints=tiny-dlm,tiny-arm", f"--output_dir={out}", "--lens_steps=every:2", "--lens_top_k=3", *SMALL]
  fx.run_binary("logit_lens", *args, "--max_items_this_run=1", "--cpu_devices=2")  # the runtime before the numerics
  assert len(fx.read_jsonl(out / "results.jsonl")) == 1 and not (out / "summary.json").exists()
  result = fx.run_binary("logit_lens", *args)  # resumes: the first line is kept, the other three are added
  assert "capture plan tiny-dlm" in result.stdout and "top-1 fraction" in result.stdout
  records = fx.read_jsonl(out / "results.jsonl")
  assert sorted((r["model"], r["item"]) for r in records) == [(m, i) for m in ("tiny-arm", "tiny-dlm") for i in "01"]
  for r in records:
    assert r["rows"] == ["embed", "0", "1", "2", "3"] and r["steps"] == [0, 2, 4, 6]
    first = np.asarray(r["first_top1"])
    assert first.shape == (4, 8) and np.array_equal((first != -2).sum(1), r["count"])
    top_last = np.asarray(r["top_tokens_last_read"])
    assert top_last.shape == (8, 5, 3) and ((top_last[:, 0, 0] == -1) == (first == -2).all(0)).all()
    if r["model"] == "tiny-arm":  # one position per step: the token generated there, top-1 at the last layer
      assert r["count"] == [1, 1, 1, 1] and r["top1_count"][0][-1] == 1
      assert np.array_equal(top_last[[0, 2, 4, 6], -1, 0], np.asarray(r["tokens"])[[0, 2, 4, 6]])
  summary = json.loads((out / "summary.json").read_text())["summary"]
  assert summary["tiny-arm"]["overall"]["top1_fraction"][-1] == 1.0
  for label in ("tiny-dlm", "tiny-arm"):
    assert summary[label]["pairs"] == sum(sum(r["count"]) for r in records if r["model"] == label)
    for name in ("lens_probability.png", "example_first_top1.png"):
      assert (out / label / name).stat().st_size > 0

  never = tmp_path / "never"
  base = ["--checkpoints=tiny-dlm", f"--output_dir={never}", *SMALL]
  cases = [(["--lens_steps=foo"], ["--lens_steps=foo"]), (["--lens_steps="], ["--lens_steps"]),
           (["--lens_steps=every:0"], ["--lens_steps=every:0", "positive"]),
           (["--lens_steps=2,2"], ["--lens_steps=2,2", "repeated"]),
           (["--lens_steps=99"], ["keeps no step"]), (["--lens_top_k=0"], ["--lens_top_k=0"]),
           (["--capture_budget_gb=1e-9"], ["--capture_budget_gb", "--lens_steps"])]
  results = fx.run_cases("logit_lens", [base + extra for extra, _ in cases])
  for (code, stderr), (extra, words) in zip(results, cases):
    lines = stderr.strip().splitlines()
    assert code == 1 and len(lines) == 1 and "Traceback" not in stderr, (extra, stderr)
    assert all(w in lines[0] for w in words), (extra, lines[0])
  assert not never.exists()
