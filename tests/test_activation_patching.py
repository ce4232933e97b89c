"""Activation patching across runs (`dlm_jax.analysis.patching_grid`, `attribution`, `PatchingResult`), the
synthetic pairs, and experiments.activation_patching end to end on the embedded models.

References are independent of the hook code: a NumPy forward written here from the params (attention
ablation), plain separate runs (the grid's per-row windows), finite differences (the gradients), NumPy
statistics (PatchingResult)."""

import functools
import json
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlm_jax import model
from dlm_jax.analysis import attribution, patching_grid
from dlm_jax.analysis.patching import PatchingResult, patch_values
from dlm_jax.config import preset
from dlm_jax.instrument.hook_call import HookCall, hook_values
from dlm_jax.instrument.hook_spec import Capture, Edit, Hooks, Steps
from dlm_jax.sampling import autoregressive, dream, llada
from dlm_jax.tasks import synthetic, synthetic_pairs
from dlm_jax.model import CallInstruments

try:
  from tests import experiments_fixtures as fx
except ImportError:
  import experiments_fixtures as fx

LP, GEN = 6, 8
SAMPLERS = {
    "llada": (preset("tiny-llada"), lambda c, p, **k: llada.generate(
        p[0], p[1], config=c, options=llada.LLaDAOptions(gen_length=GEN, steps=GEN, block_length=GEN), **k)),
    "dream": (preset("tiny-dream"), lambda c, p, **k: dream.diffusion_generate(
        p[0], p[1], config=c, options=dream.DreamOptions(gen_length=GEN, steps=GEN), **k)),
    "ar": (preset("tiny-llama"), lambda c, p, **k: autoregressive.generate(
        p[0], p[1], config=c, options=autoregressive.AROptions(gen_length=GEN), **k)),
}


@functools.lru_cache(maxsize=None)
def params_of(name):
  config = SAMPLERS[name][0]
  params = model.init_params(config, jax.random.key(7))
  params["lm_head"]["kernel"] = params["lm_head"]["kernel"] * 8.0  # confident, varied proposals
  return params


def two_prompts(seed=0):
  return np.random.default_rng(seed).integers(4, 200, size=(2, LP)).astype(np.int32)


def resid_capture_run(name, prompt):
  config, sample = SAMPLERS[name]
  hooks = Hooks(captures=(Capture("hook_resid_pre"),))
  return sample(config, (params_of(name), prompt), hooks=hooks)


@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_patching_every_layer_of_run_a_into_run_b_reproduces_a(name):
  config, sample = SAMPLERS[name]
  prompt = two_prompts()
  clean = resid_capture_run(name, prompt)
  a, b = np.asarray(clean.generated[0]), np.asarray(clean.generated[1])
  assert not np.array_equal(a, b)
  values, steps = patch_values(clean, [f"blocks.{l}.hook_resid_pre" for l in range(config.n_layers)])
  hooks = Hooks(edits=(Edit("hook_resid_pre", "replace", source="values"),))
  patched = sample(config, (params_of(name), prompt[1:]), hooks=hooks, hook_values=hook_values(
      hooks, config, 1, LP + GEN, edits={0: dict(values=values[:, :, :1], value_steps=steps)}))
  np.testing.assert_array_equal(np.asarray(patched.generated[0]), a)
  np.testing.assert_array_equal(np.asarray(patched.decode_step[0]), np.asarray(clean.decode_step[0]))


# ---------------------------------------------------------------- attention ablation vs a NumPy forward


def _np_forward(params, tokens, config, skip_attention=None):
  """LLaDA-style bidirectional forward of one row [S] in float64 from the params: logits [S, V]; the layer
  `skip_attention` adds nothing from its attention."""
  p = {k: np.asarray(v, np.float64) for k, v in model.flatten_params(params).items()}
  h_dim = config.head_dim

  def rms(x, w):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + config.norm_eps) * w

  def rope(x):
    inv = 1.0 / config.rope_theta ** (np.arange(0, h_dim, 2) / h_dim)
    angle = np.arange(x.shape[0])[:, None] * inv[None]
    angle = np.concatenate([angle, angle], -1)[:, None]
    return x * np.cos(angle) + np.concatenate([-x[..., h_dim // 2:], x[..., :h_dim // 2]], -1) * np.sin(angle)

  x = p["embed.embedding"][tokens]
  for layer in range(config.n_layers):
    w = lambda name, layer=layer: p[f"blocks.{name}"][layer]  # noqa: E731
    h = rms(x, w("attn_norm.weight"))
    q = rope((h @ w("attn.q.kernel")).reshape(-1, config.n_heads, h_dim))
    k = rope((h @ w("attn.k.kernel")).reshape(-1, config.n_kv_heads, h_dim))
    v = (h @ w("attn.v.kernel")).reshape(-1, config.n_kv_heads, h_dim)
    scores = np.einsum("tnh,snh->nts", q, k) / np.sqrt(h_dim)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    if layer != skip_attention:
      x = x + np.einsum("nts,snh->tnh", probs, v).reshape(len(tokens), -1) @ w("attn.o.kernel")
    h = rms(x, w("mlp_norm.weight"))
    gate = h @ w("mlp.gate.kernel")
    x = x + (gate / (1 + np.exp(-gate)) * (h @ w("mlp.up.kernel"))) @ w("mlp.down.kernel")
  return rms(x, p["final_norm.weight"]) @ p["lm_head.kernel"]


@pytest.mark.parametrize("layer", [0, 1])
def test_zero_ablating_attention_output_equals_a_forward_without_it(layer):
  config = SAMPLERS["llada"][0]
  params = params_of("llada")
  tokens = np.random.default_rng(1).integers(4, 250, size=(2, 10)).astype(np.int32)  # the gradient test's shape
  hooks = Hooks(edits=(Edit("hook_attn_out", "zero", layers=layer),))
  ablated = model.forward(params, jnp.asarray(tokens), config=config,
                          hooks=HookCall(hooks=hooks, values=hook_values(hooks, config, 2, 10))).logits
  plain = model.forward(params, jnp.asarray(tokens), config=config).logits  # the program the gradient test runs
  for row in range(2):
    np.testing.assert_allclose(np.asarray(plain[row]), _np_forward(params, tokens[row], config), atol=2e-4, rtol=1e-4)
    reference = _np_forward(params, tokens[row], config, skip_attention=layer)
    np.testing.assert_allclose(np.asarray(ablated[row]), reference, atol=2e-4, rtol=1e-4)
    assert np.max(np.abs(reference - np.asarray(plain[row]))) > 1e-2


# ---------------------------------------------------------------- one grid program vs separate runs


def test_grid_rows_equal_separate_runs_of_their_cells():
  config, sample = SAMPLERS["llada"]
  params, prompt = params_of("llada"), two_prompts(2)
  clean = resid_capture_run("llada", prompt)
  values, _ = patch_values(clean, [f"blocks.{l}.hook_resid_pre" for l in range(config.n_layers)])
  final = Capture("ln_final.hook_normalized", steps=Steps.decoded())
  grid_hooks = Hooks(captures=(final,), edits=(Edit("hook_resid_pre", "replace", source="values"),))
  corrupted = np.repeat(prompt[1:], config.n_layers, axis=0)
  for step, layer in ((1, 0), (3, 1)):
    edit = patching_grid.layer_step_rows(np.asarray(values)[:, :, :1], step)
    grid = sample(config, (params, corrupted), hooks=grid_hooks,
                  hook_values=hook_values(grid_hooks, config, len(corrupted), LP + GEN, edits={0: edit}))
    alone_hooks = Hooks(captures=(final,), edits=(Edit("hook_resid_pre", "replace", layers=layer, source="values"),))
    alone = sample(config, (params, prompt[1:]), hooks=alone_hooks, hook_values=hook_values(
        alone_hooks, config, 1, LP + GEN, edits={0: dict(window=(step, step + 1), values=values[:, layer:layer + 1, :1],
                                                         value_steps=np.arange(GEN))}))
    np.testing.assert_array_equal(np.asarray(grid.generated[layer]), np.asarray(alone.generated[0]))
    np.testing.assert_allclose(np.asarray(grid.captures[final.site][layer]), np.asarray(alone.captures[final.site][0]),
                               atol=1e-5)


# ---------------------------------------------------------------- attribution gradients


def test_site_gradients_match_finite_differences():
  config = SAMPLERS["llada"][0]
  params = params_of("llada")
  sequence = jnp.asarray(np.random.default_rng(3).integers(4, 250, size=(2, 10)), jnp.int32)
  metric = attribution.logit_difference_at(jnp.asarray([7, 9]), jnp.asarray([5, 6]), jnp.asarray([8, 9]))
  value, grad = attribution.site_gradients(params, sequence, metric, config=config, site="hook_mlp_out")
  plain = model.forward(params, sequence, config=config).logits
  np.testing.assert_allclose(np.asarray(value), np.asarray(metric(plain)), atol=1e-5)
  hooks = Hooks(edits=(Edit("hook_mlp_out", "add", source="values"),))
  direction = np.random.default_rng(4).normal(size=(1, config.n_layers, 2, 10, config.d_model)).astype(np.float32)

  def shifted(epsilon):
    call = HookCall(hooks=hooks, values=hook_values(hooks, config, 2, 10, edits={
        0: dict(values=epsilon * direction, value_steps=np.zeros(1, np.int32))}))
    return np.asarray(metric(model.forward(params, sequence, config=config,
                                           instruments=CallInstruments(hooks=call)).logits), np.float64)

  epsilon = 1e-2
  finite = (shifted(epsilon) - shifted(-epsilon)) / (2 * epsilon)
  linear = np.einsum("lbsd,lbsd->b", np.asarray(grad, np.float64), direction[0].astype(np.float64))
  np.testing.assert_allclose(linear, finite, rtol=2e-2, atol=1e-3)
  assert np.all(np.abs(linear) > 1e-2)


def test_sequences_before_steps_hold_the_mask_where_later_steps_decode():
  tokens = np.asarray([[9, 9, 11, 12, 13]])
  decode_step = np.asarray([[2, 0, -1]])
  canvases = attribution.sequences_before_steps(tokens, decode_step, 2, 3, np.asarray([0, 1, 3]))
  np.testing.assert_array_equal(canvases[:, 0], [[9, 9, 3, 3, 3], [9, 9, 3, 12, 3], [9, 9, 11, 12, 3]])


# ---------------------------------------------------------------- PatchingResult and pairs


def test_patching_result_mean_and_stderr_match_numpy():
  rng = np.random.default_rng(5)
  effects, clean, corrupted = rng.normal(size=(3, 6)), rng.normal(size=6) + 4, rng.normal(size=6)
  clean[2] = corrupted[2]  # no gap: left out
  result = PatchingResult(effects=effects, clean=clean, corrupted=corrupted)
  keep = np.arange(6) != 2
  normalized = (effects[:, keep] - corrupted[keep]) / (clean[keep] - corrupted[keep])
  np.testing.assert_allclose(result.mean(), normalized.mean(1))
  np.testing.assert_allclose(result.stderr(), normalized.std(1, ddof=1) / np.sqrt(5))
  np.testing.assert_allclose(result.mean(normalized=False), effects.mean(1))


def test_pairs_change_one_operand_and_the_answer():
  problems = synthetic.make_split("test", 40)
  for i, problem in enumerate(problems):
    assert synthetic_pairs.solve(problem.question)[0] == problem.answer
    pair = synthetic_pairs.corrupt(problem, random.Random(i))
    clean_words, corrupted_words = problem.question.split(), pair.corrupted.question.split()
    assert len(clean_words) == len(corrupted_words)
    assert sum(a != b for a, b in zip(clean_words, corrupted_words)) == 1
    assert pair.clean.answer.split()[-1] != pair.corrupted.answer.split()[-1]
    assert all(0 <= int(n) <= synthetic.MAX_VALUE for n in pair.corrupted.answer.replace(".", " ").split()
               if n.isdigit())


# ---------------------------------------------------------------- the binary

BINARY_FLAGS = ["--checkpoints=tiny-dlm,tiny-arm", "--n_pairs=2", "--pairs_per_call=2",
                "--sites=hook_resid_pre,attn.hook_z", "--patch_steps=12,13", "--nobatch_invariant"]
BAD_FLAGS = [("--sites=hook_foo", "unknown site 'hook_foo'"), ("--sites=blocks.1.hook_resid_pre", "a site kind"),
             ("--patch_steps=", "--patch_steps is empty"), ("--patch_steps=99", "decodes in 32 steps"),
             ("--checkpoints=tiny-uniform-dlm", "diffusion_gemma"),
             ("--capture_budget_gb=0.001", "over --capture_budget_gb")]


@pytest.fixture(scope="module")
def binary_runs(tmp_path_factory):
  """The binary's run on the embedded models, then each refused flag, in one process (no process boundary is
  tested; the rerun of the finished run is a process of its own, in its test): (output directory of the run,
  its (exit code, stderr, stdout), the refused cases' output directory, their (exit code, stderr, stdout))."""
  root = tmp_path_factory.mktemp("activation_patching")
  out, refused_out = root / "out", root / "refused"
  cases = [("experiments.activation_patching", [*BINARY_FLAGS, f"--output_dir={out}"])]
  cases += [("experiments.activation_patching", ["--checkpoints=tiny-dlm", f"--output_dir={refused_out}", "--n_pairs=1",
                                                 flag]) for flag, _ in BAD_FLAGS]
  results = fx.run_modules(cases)
  return out, results[0], refused_out, results[1:]


def test_binary_on_the_embedded_models(binary_runs):
  out, (code, stderr, stdout), _, _ = binary_runs
  assert code == 0, f"stdout:\n{stdout[-3000:]}\nstderr:\n{stderr[-6000:]}"
  records = fx.read_jsonl(out / "results.jsonl")
  assert sorted((r["model"], r["item"]) for r in records) == [(m, i) for m in ("tiny-arm", "tiny-dlm") for i in "01"]
  summary = json.loads((out / "summary.json").read_text())["summary"]
  for label in ("tiny-dlm", "tiny-arm"):
    s = summary[label]
    assert np.asarray(s["sites"]["hook_resid_pre"]["mean_normalized"]).shape == (4, 2)
    assert np.asarray(s["heads"]["attn.hook_z"]["mean_normalized"]).shape == (1, 4, 4)
    for name in ("hook_resid_pre.png", "heads.png"):
      assert (out / label / name).stat().st_size > 0
  attribution_summary = summary["tiny-dlm"]["attribution"]["hook_resid_pre"]
  assert attribution_summary["max_metric_gap"] < 1e-3
  # Measured for this run (2 pairs, steps 12-13, 16 cells): r = 0.927, signs agree in 16 of 16 cells; over all 32
  # steps of 6 pairs (docs/results/activation_patching) r = 0.70 and 85% of the signs agree.
  assert attribution_summary["pearson_r"] > 0.8 and attribution_summary["sign_agreement"] >= 0.9
  assert summary["tiny-arm"]["attribution"] == {}
  before = (out / "results.jsonl").read_text()
  again = fx.run_binary("activation_patching", *BINARY_FLAGS, f"--output_dir={out}")
  assert (out / "results.jsonl").read_text() == before and "Results written" in again.stdout + again.stderr


def test_bad_flags_give_one_line_exit_1_and_leave_nothing(binary_runs):
  _, _, out, refused = binary_runs
  for (code, stderr, _), (flag, message) in zip(refused, BAD_FLAGS):
    lines = [l for l in stderr.strip().splitlines() if l.strip() and not l.startswith(("I1", "W1"))]
    assert code == 1 and len(lines) == 1 and message in lines[0], (flag, stderr[-2000:])
  assert len(refused) == len(BAD_FLAGS) and not out.exists()
