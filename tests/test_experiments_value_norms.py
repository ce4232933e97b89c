"""experiments.value_norms end to end on tiny random checkpoints (a DLM and an ARM): every valid
(step, layer, head, key) is counted once, as a sink or a normal token, with its kv head's value norm."""

import json

import numpy as np

try:
  from tests import experiments_fixtures as fx
except ImportError:
  import experiments_fixtures as fx


def test_value_norms_end_to_end(tmp_path):
  root = tmp_path / "ckpt"
  dlm = fx.tiny_checkpoint(str(root / "dlm"), "dlm", seed=5)
  arm = fx.tiny_checkpoint(str(root / "arm"), "arm", seed=6)
  out = tmp_path / "out"
  result = fx.run_binary("value_norms", f"--checkpoints=dlm={dlm},arm={arm}", f"--output_dir={out}", "--n_prompts=3",
                         "--batch_size=2", "--gen_length=8", "--steps=8", "--block_length=4", "--layers=1")
  assert "mean sink norm" in result.stdout
  records = fx.read_jsonl(out / "results.jsonl")
  assert sorted((r["model"], r["item"]) for r in records) == sorted((m, str(i)) for m in ("dlm", "arm") for i in range(3))
  summary = json.loads((out / "summary.json").read_text())["summary"]
  # DLM: 8 steps x 1 layer x 4 heads x (36 prompt + 8 generated) keys per prompt, all valid (visible pads).
  dlm_rows = [r for r in records if r["model"] == "dlm"]
  assert all(r["sink_count"][0] + r["normal_count"][0] == 8 * 4 * 44 for r in dlm_rows)
  assert summary["dlm"]["layers"] == [1]
  for label in ("dlm", "arm"):
    s = summary[label]
    assert s["normal_count"] > 0 and np.isfinite(s["normal_mean"]) and s["normal_mean"] > 0
    assert (out / label / "fig1_value_norms.png").stat().st_size > 0
    assert (out / label / "value_norms_per_layer.png").stat().st_size > 0
