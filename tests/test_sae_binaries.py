"""experiments.train_sae and experiments.evaluate_sae end to end on a random tiny LLaDA-style checkpoint: outputs,
resume (nothing recomputed), SAEs readable by sae-lens's loader format, and bad input as one line before any
model work."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

import experiments_fixtures as fx
from dlm_jax.io import saelens


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  root = tmp_path_factory.mktemp("sae_binaries")
  checkpoint = fx.tiny_checkpoint(str(root / "dlm"), "dlm")
  train = str(root / "train")
  common = [f"--checkpoint={checkpoint}", "--gen_length=8", "--batch_size=4"]
  train_args = [*common, f"--output_dir={train}", "--n_train=4", "--train_steps=20", "--train_batch_size=32",
                "--d_sae=32", "--k=4", "--checkpoint_every=10"]
  train_results = fx.run_cases("train_sae", [train_args, train_args,
                                             [*train_args[:-4], "--d_sae=8", "--k=9"],
                                             [*common, "--layers=7", f"--output_dir={root / 'bad'}"]])
  evaluation = str(root / "eval")
  eval_args = [*common, f"--sae_run={train}", "--n=4", "--step_bin=4", f"--output_dir={evaluation}"]
  wrong = str(root / "wrong_site")
  shutil.copytree(os.path.join(train, "saes", "blocks.0.hook_resid_post"), wrong)
  cfg = json.load(open(os.path.join(wrong, "cfg.json")))
  cfg["metadata"]["hook_name"] = "blocks.0.mlp.hook_post"
  json.dump(cfg, open(os.path.join(wrong, "cfg.json"), "w"))
  eval_results = fx.run_cases("evaluate_sae", [eval_args, eval_args,
                                               [*common, f"--saes={wrong}", f"--output_dir={root / 'bad_eval'}"]])
  return {"root": root, "train": train, "evaluation": evaluation, "train_results": train_results,
          "eval_results": eval_results}


def test_train_sae_outputs_and_resume(runs):
  (code, err), (again, again_err) = runs["train_results"][:2]
  assert code == 0, err[-3000:]
  assert again == 0, again_err[-3000:]
  assert "resumed" not in again_err and "activations: 4/4" not in again_err  # nothing recomputed
  layers = fx.read_jsonl(os.path.join(runs["train"], "layers.jsonl"))
  assert [r["site"] for r in layers] == ["blocks.0.hook_resid_post", "blocks.1.hook_resid_post"]
  assert all(r["steps"] == 20 and r["rows"] == 4 * 8 * 8 for r in layers)
  for record in layers:
    loaded = saelens.load(os.path.join(runs["train"], "saes", record["site"]))
    assert loaded.hook_name == record["site"] and loaded.sae.architecture == "topk" and loaded.sae.k == 4
  assert os.path.getsize(os.path.join(runs["train"], "training.png")) > 0
  summary = json.load(open(os.path.join(runs["train"], "train.json")))
  assert set(summary["layers"]) == {r["site"] for r in layers}


def test_train_sae_bad_flags_are_one_line(runs):
  for code, err in runs["train_results"][2:]:
    assert code == 1
    assert "error: --" in err.strip().splitlines()[-1], err[-2000:]
  assert runs["train_results"][2][1].strip().endswith("--k=9: expected at most --d_sae=8")
  assert runs["train_results"][3][1].strip().endswith("--layers=7: --layers has 2 layers (0 to 1)")
  assert not os.path.exists(runs["root"] / "bad")


def test_evaluate_sae_grid_resume_and_bad_sae(runs):
  (code, err), (again, again_err), (bad, bad_err) = runs["eval_results"]
  assert code == 0, err[-3000:]
  assert again == 0, again_err[-3000:]
  lines = fx.read_jsonl(os.path.join(runs["evaluation"], "conditions.jsonl"))
  assert len(lines) == 1 + 2 * 3  # clean + 2 sites × (2 bins + every step), written once although run twice
  results = json.load(open(os.path.join(runs["evaluation"], "results.json")))
  assert results["bins"] == [[0, 4], [4, 8]]
  assert np.array(results["delta_ce"]).shape == (2, 3) and np.isfinite(results["delta_ce"]).all()
  assert np.array(results["delta_accuracy"]).shape == (2, 3)
  assert all(0 <= a <= 1 for a in results["accuracy"].values())
  clean_ce = np.array(results["cross_entropy_per_step"]["clean"])
  assert np.isfinite(clean_ce[0]) and (clean_ce[np.isfinite(clean_ce)] >= 0).all()
  ev = results["reconstruction"]["blocks.1.hook_resid_post"]["0-4"]["generated"]
  assert ev["rows"] == 4 * 4 * 8 and 0 <= ev["dead_fraction"] <= 1
  assert os.path.getsize(os.path.join(runs["evaluation"], "grid.png")) > 0
  assert bad == 1, bad_err[-2000:]
  assert bad_err.strip().splitlines()[-1].endswith("the SAE's d_in is 64, but blocks.0.mlp.hook_post of test-dlm has "
                                                   "128 features."), bad_err[-2000:]
  assert not os.path.exists(runs["root"] / "bad_eval")
