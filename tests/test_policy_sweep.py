"""`experiments.policy_sweep` end to end in one subprocess: per-item FLOPs equal to an independent count of what
each policy computes by its rule, a resumed run adding nothing, the report and Pareto figure, and one-line
refusals."""

import json
import os

import numpy as np

try:
  from tests import experiments_fixtures as fx
except ImportError:  # run from inside tests/
  import experiments_fixtures as fx


def _call_flops(c: dict, rows: int, keys: int) -> float:
  """Trunk matmul FLOPs of `rows` queries reading `keys` keys, from a config.json written for the count here."""
  d, n, h, kv, f = c["d_model"], c["n_heads"], c["head_dim"], c["n_kv_heads"], c["mlp_hidden"]
  weights = d * n * h + 2 * d * kv * h + n * h * d + 3 * d * f
  return c["n_layers"] * (2.0 * weights * rows + 4.0 * rows * keys * n * h)


def test_the_sweep_records_what_each_policy_computed(tmp_path):
  out = str(tmp_path / "sweep")
  common = ["--n_prompts=2", "--batch_size=2", "--policies=none,sparse_dllm", "--keep_ratios=0.5",
            "--keep_sinks=0", "--condition=sparse_dllm:keep_ratio=0.5,keep_sinks=0", f"--output_dir={out}"]
  results = fx.run_cases("policy_sweep", [common, common, common[:-1] + ["--keep_ratios=2", f"--output_dir={out}x"],
                                          common[:-1] + ["--policies=fast", f"--output_dir={out}y"]])
  assert [code for code, _ in results[:2]] == [0, 0], results[0][1][-3000:]
  for code, err in results[2:]:
    assert code == 1 and len(err.strip().splitlines()) == 1, err
  assert "keep_ratio must be a number in (0, 1]" in results[2][1] and "'fast' is not one of" in results[3][1]
  # the second run resumed: nothing added; the --condition equal to a grid point is not decoded twice
  records = fx.read_jsonl(os.path.join(out, "results.jsonl"))
  assert len(records) == 4 and {r["policy"] for r in records} == {"none", "sparse_dllm:keep_ratio=0.5,keep_sinks=0"}
  with open(os.path.join(fx.ROOT, "dlm_jax", "default_models", "tiny-dlm", "config.json"), encoding="utf-8") as f:
    config = json.load(f)
  with open(os.path.join(out, "summary.json"), encoding="utf-8") as f:
    summary = json.load(f)
  settings = summary["models"][0]["settings"]
  block, steps, g = settings["block_length"], settings["steps"], settings["gen_length"]
  per_block = steps // (g // block)
  for r in records:
    s = r["seq_len"]
    if r["policy"] == "none":
      expected = r["nfe"] * _call_flops(config, s, s)
    else:  # full at a block's steps 0 and 1, then the block's queries over the kept keys and the block
      keep = int((s - block) * 0.5)
      expected = sum(_call_flops(config, s, s) if i % per_block <= 1 else _call_flops(config, block, keep + block)
                     for i in range(r["nfe"]))
    np.testing.assert_allclose(r["flops"], expected, rtol=1e-6)
  for r in records:  # the share of attention outside the block that the kept keys leave out (analysis/policy_metrics)
    if r["policy"] == "none":
      assert r["dropped_attention"] is None
    else:
      assert 0 < r["dropped_attention"] < 1
  per = summary["summary"]["tiny-dlm"]
  none = [r for r in records if r["policy"] == "none"]
  np.testing.assert_allclose(per["none"]["flops_per_token"], np.mean([r["flops"] / r["gen_length"] for r in none]))
  assert per["sparse_dllm:keep_ratio=0.5,keep_sinks=0"]["flops_ratio"] < 1
  assert os.path.exists(os.path.join(out, "tiny-dlm", "pareto.png"))
