"""The clock-steering analysis against NumPy, steering files with step schedules (old files read as before), and
`experiments.steering_sweep` end to end: resume, the unsteered baseline, figures and one-line refusals."""

import json

import jax
import numpy as np
import pytest

from dlm_jax.analysis import clock_steering
from dlm_jax.config import preset
from dlm_jax.model import init_params
from dlm_jax.session import SessionError, steering_file

try:
  from tests import experiments_fixtures as fx
except ImportError:  # run from inside tests/
  import experiments_fixtures as fx

jax.config.update("jax_default_matmul_precision", "highest")

CONFIG = preset("tiny-llada")


def test_step_confidence_entropy_and_clock_equal_numpy():
  params = init_params(CONFIG, jax.random.key(0))
  rng = np.random.default_rng(0)
  n, b, s, d = 3, 2, 6, CONFIG.d_model
  hidden = rng.normal(size=(n, b, s, d)).astype(np.float32)
  hidden[1, 0, 4] = 0.0  # a position the step did not compute
  decode_step = np.array([[0, 2, -1, 1], [1, 1, 2, 0]])
  masked = clock_steering.masked_at_steps(decode_step, n, 2)
  assert masked.shape == (n, b, s) and not masked[..., :2].any()
  assert masked[1, 0, 2:].tolist() == [False, True, True, True] and masked[2, 1, 2:].tolist() == [False, False, True,
                                                                                                   False]
  confidence, entropy, count = clock_steering.step_confidence_entropy(params, CONFIG, hidden, masked)
  head = np.asarray(params["lm_head"]["kernel"], np.float64)
  for t in range(n):
    for row in range(b):
      read = masked[t, row] & np.any(hidden[t, row] != 0, axis=-1)
      logits = hidden[t, row][read].astype(np.float64) @ head
      p = np.exp(logits - logits.max(-1, keepdims=True))
      p /= p.sum(-1, keepdims=True)
      assert count[t, row] == read.sum()
      if read.any():
        np.testing.assert_allclose(confidence[t, row], p.max(-1).mean(), atol=1e-5)
        np.testing.assert_allclose(entropy[t, row], -(p * np.log(p)).sum(-1).mean(), atol=1e-5)
  assert count[1, 0] == 2  # position 4 was masked but not computed
  means = rng.normal(size=(4, 2, 3))
  counts = np.array([[1, 0], [2, 1], [0, 3], [1, 1]])
  bins = clock_steering.step_bins(4, 2)
  assert bins.tolist() == [0, 0, 1, 1]
  pooled = clock_steering.bin_means(means, counts, bins, 2)
  np.testing.assert_allclose(pooled[0], (means[0, 0] + 2 * means[1, 0] + means[1, 1]) / 4)
  np.testing.assert_allclose(clock_steering.clock_vectors(pooled, 1), [pooled[1] - pooled[0], np.zeros(3)], atol=1e-6)
  with pytest.raises(ValueError, match=r"step bin 0 \(steps \[0, 1\]\) has no masked position"):
    clock_steering.bin_means(means, np.array([[0, 0], [0, 0], [1, 1], [1, 1]]), bins, 2)


def _write(path, spec):
  path.write_text(json.dumps(spec))
  return str(path)


def test_steering_files_with_schedules_and_old_files(tmp_path):
  d = CONFIG.d_model
  old = _write(tmp_path / "old.json", {"blocks.1.hook_resid_post": {"vector": [0.5] * d, "coefficient": 2,
                                                                   "steps": [1, 3]}})
  hooks, values = steering_file.steering(old, CONFIG, 2, 12)
  assert hooks.edits[0].schedule is None and not hooks.captures
  assert np.asarray(values.edits[0].window).tolist() == [[1, 3], [1, 3]]
  np.save(tmp_path / "vectors.npy", np.arange(2 * d, dtype=np.float32).reshape(2, d))
  new = _write(tmp_path / "new.json", {"blocks.1.hook_resid_post": {
      "vector": "vectors.npy", "coefficient": 1.5, "schedule": [0, 1, 1, 0.5], "bins": [0, 0, 1, 1],
      "positions": "committed",
      "gate": {"site": "blocks.0.hook_resid_post", "direction": [1.0] * d, "scale": 2, "bias": -1}}})
  hooks, values = steering_file.steering(new, CONFIG, 2, 12)
  edit = hooks.edits[0]
  assert edit.positions == "committed" and edit.schedule.n_steps == 4 and edit.schedule.n_bins == 2
  assert hooks.captures[0].layers == (0,) and hooks.captures[0].reduce == "project"
  assert edit.schedule.gate.capture == "steering_gate_0.0"
  v = values.edits[0]
  assert np.asarray(v.schedule.table).tolist() == [[0, 1, 1, 0.5]] * 2
  assert np.asarray(v.schedule.bins).tolist() == [[0, 0, 1, 1]] * 2
  assert np.asarray(v.vector).shape == (2, 2, d) and float(v.coefficient[0]) == 1.5
  assert float(v.schedule.gate_scale[0]) == 2.0 and float(v.schedule.gate_bias[0]) == -1.0
  window = _write(tmp_path / "window.json", {"blocks.1.hook_resid_post": {
      "vector": [1.0] * d, "steps": [2, 4], "gate": {"site": "blocks.0.hook_resid_post", "reduce": "norm"}}})
  hooks, values = steering_file.steering(window, CONFIG, 1, 12)
  assert np.asarray(values.edits[0].schedule.table).tolist() == [[0, 0, 1, 1]]
  assert hooks.captures[0].reduce == "norm"

  bad = [({"vector": [1.0] * d, "schedule": [1, "x"]}, "schedule must be a non-empty list of finite numbers"),
         ({"vector": [1.0] * d, "schedule": [1], "steps": [0, 1]}, "either steps (a window) or schedule"),
         ({"vector": [1.0] * d, "schedule": [1, 1], "bins": [0]}, "bins has 1 steps but schedule has 2"),
         ({"vector": [1.0] * d, "gate": {"site": "blocks.0.hook_resid_post", "reduce": "norm"}},
          "a gate needs schedule, bins or steps"),
         ({"vector": [1.0] * d, "steps": [0, 2], "gate": {"site": "blocks.1.hook_resid_pre", "reduce": "norm"}},
          "must be a per-layer site before layer 1"),
         ({"vector": [1.0] * d, "steps": [0, 2], "gate": {"site": "blocks.0.hook_resid_post"}},
          "a gate with reduce 'project' needs a direction"),
         ({"vector": [1.0] * d, "bins": [0, 1]}, "vector must be [2, 64] finite numbers"),
         ({"vector": [[1.0] * d], "bins": [0, 0], "steps": [0, 3]}, "names step 2, but the sampler runs at most 2")]
  for i, (entry, words) in enumerate(bad):
    path = _write(tmp_path / f"bad{i}.json", {"blocks.1.hook_resid_post": entry})
    with pytest.raises(SessionError) as error:
      steering_file.steering(path, CONFIG, 1, 12)
    assert words in str(error.value) and "\n" not in str(error.value), (entry, str(error.value))


SMALL = ["--n_prompts=2", "--batch_size=2", "--gen_length=8", "--steps=8", "--block_length=4", "--n_bins=2",
         "--coefficients=0,2"]


def test_binary_end_to_end_resumes_and_refuses_in_one_line(tmp_path):
  out = tmp_path / "out"
  never = tmp_path / "never"
  args = ["--checkpoints=tiny-dlm", "--schedules=window:2-6,gated", *SMALL]
  refusals = [(["--schedules=window:4-9"], ["--schedules=window:4-9", "names step 8", "at most 8 steps"]),
              (["--schedules=bogus"], ["--schedules=bogus", "expected one of"]),
              (["--coefficients=1,2"], ["--coefficients=1.0,2.0", "expected 0"]),
              (["--checkpoints=tiny-arm"], ["tiny-arm", "masked diffusion models"]),
              (["--n_bins=9"], ["--n_bins=9", "runs 8 steps"])]
  results = fx.run_cases("steering_sweep", [
      [*args, f"--output_dir={out}", "--max_items_this_run=3"], [*args, f"--output_dir={out}"],
      *[[*args, f"--output_dir={never}", *extra] for extra, _ in refusals]])
  assert [code for code, _ in results[:2]] == [0, 0], results[:2]
  for (code, stderr), (extra, words) in zip(results[2:], refusals):
    lines = stderr.strip().splitlines()
    assert code == 1 and len(lines) == 1 and "Traceback" not in stderr, (extra, stderr)
    assert all(w in lines[0] for w in words), (extra, lines[0])
  assert not never.exists()
  records = fx.read_jsonl(out / "results.jsonl")
  keys = [(r["schedule"], r["coefficient"], r["item"]) for r in records]
  assert len(keys) == len(set(keys)) == 2 * 2 * 2
  by_key = {(r["schedule"], r["coefficient"], r["item"]): r for r in records}
  for item in "01":  # coefficient 0 is the plain run under every schedule; a window from step 2 leaves steps 0-1
    base = by_key[("window:2-6", 0.0, item)]
    assert by_key[("gated", 0.0, item)]["tokens"] == base["tokens"]
    assert by_key[("gated", 0.0, item)]["confidence"] == base["confidence"]
    steered = by_key[("window:2-6", 2.0, item)]
    assert steered["confidence"][:2] == base["confidence"][:2]
    assert len(base["confidence"]) == 8 and base["masked_read"][0] > 0
  assert any(by_key[("gated", 2.0, i)]["confidence"] != by_key[("gated", 0.0, i)]["confidence"] for i in "01")
  assert any(by_key[("window:2-6", 2.0, i)]["confidence"][2:6] != by_key[("window:2-6", 0.0, i)]["confidence"][2:6]
             for i in "01")
  summary = json.loads((out / "summary.json").read_text())["summary"]["tiny-dlm"]
  assert summary["steps"] == 8 and summary["tables"]["window:2-6"] == [0, 0, 1, 1, 1, 1, 0, 0]
  assert summary["per_schedule"]["gated"]["0.0"]["tokens_changed"] == 0.0
  for name in ("confidence_per_step.png", "entropy_per_step.png", "example_answers.png", "clock.npz"):
    assert (out / "tiny-dlm" / name).stat().st_size > 0
  clock = np.load(out / "tiny-dlm" / "clock.npz")
  vectors = clock["blocks.2.hook_resid_post:vectors"]
  assert vectors.shape == (2, 128) and not vectors[-1].any() and vectors[0].any()
