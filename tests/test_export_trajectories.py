"""experiments.export_trajectories and experiments.probe_grid on the embedded tiny-dlm: confidence and entropy
equal a NumPy LM head on the exported final-normed states, position classes and tokens equal a NumPy loop over
the decode steps, a killed export resumes to the same bytes, and bad input is one line before model work."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from dlm_jax import default_models
from dlm_jax.io import checkpoint
from dlm_jax.io.trajectory_dataset import open_trajectory_dataset

try:
  from tests import experiments_fixtures as fx
except ImportError:
  import experiments_fixtures as fx

SMALL = ["--checkpoints=tiny-dlm", "--n_prompts=3", "--batch_size=2", "--gen_length=8", "--steps=8",
         "--block_length=8", "--sites=blocks.1.hook_resid_post,ln_final.hook_normalized",
         "--position_classes=prompt,masked,decoded,committed"]

_DRIVER = r"""
import json, sys
from absl import flags
from experiments import export_trajectories as ex
from experiments.common import cli
from dlm_jax.io import trajectory_dataset as td
base, out = json.loads(sys.argv[1]), sys.argv[2]

def run(args):
  flags.FLAGS.unparse_flags()
  cli.call(ex.main, flags.FLAGS(["experiments.export_trajectories"] + args))

run(base + ["--output_dir=" + out + "/whole"])
write = td.TrajectoryWriter.write_shard
def killed_after_first(self, index, arrays):
  write(self, index, arrays)
  if index == 0:
    raise RuntimeError("killed after shard 0")
td.TrajectoryWriter.write_shard = killed_after_first
try:
  run(base + ["--output_dir=" + out + "/resumed"])
except (RuntimeError, SystemExit) as error:
  print("killed:", error)
td.TrajectoryWriter.write_shard = write
run(base + ["--output_dir=" + out + "/resumed"])
"""


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  out = tmp_path_factory.mktemp("export")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  done = subprocess.run([sys.executable, "-c", _DRIVER, json.dumps(SMALL), str(out)], cwd=fx.ROOT, env=env,
                        capture_output=True, text=True, timeout=600, check=False)
  assert done.returncode == 0, done.stderr[-4000:]
  assert "killed:" in done.stdout
  return out


def _files(path):
  out = {}
  for root, _, names in os.walk(path):
    for name in names:
      if not name.startswith("."):
        out[os.path.relpath(os.path.join(root, name), path)] = open(os.path.join(root, name), "rb").read()
  return out


def test_killed_export_resumes_to_the_same_bytes(exported):
  whole, resumed = _files(exported / "whole" / "tiny-dlm"), _files(exported / "resumed" / "tiny-dlm")
  assert sorted(whole) == sorted(resumed) and len(whole) > 2
  assert all(whole[name] == resumed[name] for name in whole)


def test_readings_equal_numpy_on_the_same_captures(exported):
  ds = open_trajectory_dataset(str(exported / "whole" / "tiny-dlm"), verify=True)
  config, params = checkpoint.load(default_models.path("tiny-dlm"))
  assert ds.manifest["model"]["config_sha256"] and ds.num_rows == len(ds.column("step"))
  h = ds.column("ln_final.hook_normalized").astype(np.float64)
  head = np.asarray(params["embed"]["embedding"] if config.tied_embeddings else params["lm_head"]["kernel"].T,
                    np.float64)
  logits = h @ head.T
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  np.testing.assert_allclose(ds.column("confidence"), p.max(-1), atol=1e-5)
  np.testing.assert_allclose(ds.column("entropy"), -(p * np.log(np.maximum(p, 1e-300))).sum(-1), atol=1e-5)
  np.testing.assert_array_equal(ds.column("predicted_token"), p.argmax(-1))
  # Position classes, tokens and decoded_next by a loop over the rows, from decode_step alone.
  mask_id = ds.manifest["settings"]["mask_id"]
  codes = ds.manifest["settings"]["position_class_codes"]
  for step, pos, klass, token, final, d, nxt in zip(*(ds.column(c) for c in (
      "step", "position", "position_class", "token", "final_token", "decode_step", "decoded_next"))):
    if pos < 0:
      want = "prompt"
    elif d < 0 or d >= step:
      want = "masked"
    else:
      want = "committed" if d == step - 1 else "decoded"
    assert klass == codes[want] and token == (mask_id if want == "masked" else final)
    assert nxt == int(want == "masked" and d == step)
  # The row's step and position: at the step that decodes a position (low confidence at temperature 0), the
  # model's argmax there is the token decoded.
  now = ds.column("decoded_next") == 1
  assert now.sum() == 3 * 8 and np.array_equal(ds.column("predicted_token")[now], ds.column("final_token")[now])
  steps, items = ds.column("step"), ds.column("item")
  np.testing.assert_allclose(ds.column("progress"), steps / 7, rtol=1e-6)  # 8 steps run
  assert sorted(set(steps)) == list(range(8)) and sorted(set(items)) == [0, 1, 2]
  for item in range(3):  # every step holds every position: 36 prompt + 8 generated
    assert np.all(np.bincount(steps[items == item]) == 44)
  assert ds.column("blocks.1.hook_resid_post").shape == (ds.num_rows, config.d_model)


def test_probe_grid_on_the_export_and_bad_input(exported, tmp_path):
  dataset = exported / "whole" / "tiny-dlm"
  out = tmp_path / "grid"
  grid = ["--dataset=" + str(dataset), "--n_boot=10", "--test_fraction=0.34"]
  cases = [grid + ["--output_dir=" + str(out), "--targets=progress,decoded_next", "--sites=blocks.1.hook_resid_post",
                   "--position_classes=masked"],
           grid + ["--output_dir=" + str(tmp_path / "x"), "--targets=decoded_next", "--position_classes=decoded"],
           grid + ["--output_dir=" + str(tmp_path / "x"), "--targets=loss"],
           grid + ["--output_dir=" + str(tmp_path / "x"), "--sites=blocks.3.hook_resid_post"],
           ["--dataset=" + str(tmp_path), "--output_dir=" + str(tmp_path / "x")]]
  results = fx.run_cases("probe_grid", cases)
  assert results[0][0] == 0, results[0][1][-3000:]
  for (code, stderr), words in zip(results[1:], (["--targets=decoded_next", "one class"], ["--targets=loss"],
                                                 ["--sites", "blocks.3.hook_resid_post"], ["no manifest.json"])):
    lines = stderr.strip().splitlines()
    assert code == 1 and len(lines) == 1 and all(w in lines[0] for w in words), stderr
  assert not (tmp_path / "x").exists()
  records = fx.read_jsonl(out / "results.jsonl")
  assert {(r["target"], r["step_bin"]) for r in records} == {("progress", -1)} | {("decoded_next", s) for s in range(8)}
  progress = [r for r in records if r["target"] == "progress"][0]
  assert progress["metric"] == "r2" and np.isfinite(progress["position_only"]["value"])
  summary = json.loads((out / "summary.json").read_text())
  assert summary["grids"]["decoded_next/masked"]["step_bins"] == [str(s) for s in range(8)]
  assert (out / "progress.png").stat().st_size > 0 and (out / "decoded_next_masked.png").stat().st_size > 0


def test_export_bad_input_is_one_line_before_model_work(exported, tmp_path):
  never = tmp_path / "never"
  base = [a for a in SMALL if not a.startswith("--checkpoints")]
  cases = [(["--checkpoints=tiny-arm"], ["tiny-arm", "masked-diffusion"]),
           (["--checkpoints=tiny-dlm", "--sites=blocks.9.hook_resid_post"], ["--sites", "layers 0..3"]),
           (["--checkpoints=tiny-dlm", "--sites=hook_nothing"], ["--sites", "unknown site"]),
           (["--checkpoints=tiny-dlm", "--export_steps=99"], ["--export_steps=99", "keeps no step"]),
           (["--checkpoints=tiny-dlm", "--export_steps=every:x"], ["--export_steps=every:x"]),
           (["--checkpoints=tiny-dlm", "--position_classes=sideways"], ["--position_classes=sideways"])]
  results = fx.run_cases("export_trajectories", [base + extra + [f"--output_dir={never}"] for extra, _ in cases] +
                         [SMALL + ["--export_steps=every:2", f"--output_dir={exported / 'whole'}"]])
  for (code, stderr), (extra, words) in zip(results, cases + [([], ["other settings"])]):
    lines = stderr.strip().splitlines()
    assert code == 1 and len(lines) == 1 and "Traceback" not in stderr, (extra, stderr)
    assert all(w in lines[0] for w in words), (extra, lines[0])
  assert not never.exists()


def test_train_sae_on_the_export(exported, tmp_path):
  """experiments.train_sae --dataset: trains on the dataset's rows of the site; a missing column and a dataset of
  another model are one line before any model work."""
  dataset = exported / "whole" / "tiny-dlm"
  train = ["--checkpoint=tiny-dlm", f"--dataset={dataset}", "--train_steps=4", "--train_batch_size=8", "--d_sae=16",
           "--k=2", "--checkpoint_every=0"]
  results = fx.run_cases("train_sae", [train + ["--layers=1", f"--output_dir={tmp_path / 'sae'}"],
                                       train + ["--layers=0", f"--output_dir={tmp_path / 'x'}"],
                                       [a.replace("tiny-dlm", "tiny-moe-dlm", 1) if a.startswith("--checkpoint=")
                                        else a for a in train] + ["--layers=1", f"--output_dir={tmp_path / 'x'}"]])
  assert results[0][0] == 0, results[0][1][-3000:]
  rows = open_trajectory_dataset(str(dataset)).num_rows
  (layer,) = fx.read_jsonl(tmp_path / "sae" / "layers.jsonl")
  assert layer["site"] == "blocks.1.hook_resid_post" and layer["rows"] == rows and layer["steps"] == 4
  run = json.loads((tmp_path / "sae" / "run.json").read_text())
  assert run["dataset"]["rows"] == rows and not (tmp_path / "sae" / "activations.npz").exists()
  for (code, stderr), words in zip(results[1:], (["--dataset", "blocks.0.hook_resid_post"], ["--dataset"])):
    lines = stderr.strip().splitlines()
    assert code == 1 and len(lines) == 1 and all(w in lines[0] for w in words), stderr
  assert not (tmp_path / "x").exists()
