"""experiments.sink_token end to end with a few training steps: every variant trains, is evaluated and
reported; the zero-value sink keeps a zero value vector."""

import json

import numpy as np

from dlm_jax.policy.registry import parse_policy
from dlm_jax.session import checkpoint_bundle
from experiments.common import decoding

try:
  from tests import experiments_fixtures as fx
except ImportError:
  import experiments_fixtures as fx


def test_sink_token_end_to_end(tmp_path):
  out = tmp_path / "out"
  flags = (f"--output_dir={out}", "--variants=none,front,front_zero", "--train_steps=4", "--train_batch_size=4",
           "--train_size=64", "--n_eval=4", "--batch_size=2", "--log_every=2", "--warmup=1", "--gen_length=8",
           "--steps=8", "--block_length=4")
  result = fx.run_binary("sink_token", *flags)
  assert "held-out loss" in result.stdout
  records = fx.read_jsonl(out / "results.jsonl")
  assert sorted((r["kind"], r["variant"]) for r in records) == sorted(
      (k, v) for k in ("train", "eval") for v in ("none", "front", "front_zero"))
  summary = json.loads((out / "summary.json").read_text())
  for variant in ("none", "front", "front_zero"):
    train, ev = summary["train"][variant], summary["eval"][variant]
    assert train["steps"] == 4 and list(train["loss_curve"]) == ["2", "4"]
    assert np.isfinite(train["heldout_loss"])
    assert ev["n"] == 4 and 0 <= ev["accuracy"] <= 1
    assert len(ev["top_key_mass_per_layer"]) == 2
    assert (out / "models" / variant / "config.json").exists()
  assert summary["eval"]["none"]["sink_mass_per_layer"] is None
  for variant in ("front", "front_zero"):
    mass = np.asarray(summary["eval"][variant]["sink_mass_per_layer"])
    assert mass.shape == (2,) and np.all((mass > 0) & (mass < 1))
  np.testing.assert_allclose(summary["eval"]["front_zero"]["sink_value_norm_per_layer"], 0.0, atol=1e-6)
  assert summary["eval"]["front"]["sink_value_norm_per_layer"][0] > 0
  for name in ("loss_curves.png", "sink_mass_per_layer.png", "value_norms_per_layer.png", "summary.md"):
    assert (out / name).stat().st_size > 0
  # a key-subset compute policy always keeps the extra sink token of a model trained with one
  bundles = {v: checkpoint_bundle.describe(v, str(out / "models" / v), "auto", "auto") for v in ("none", "front")}
  policy = parse_policy("sparse_dllm:keep_ratio=0.25")
  assert decoding.sink_token_kept(bundles["front"], policy).keep_first == 1
  assert decoding.sink_token_kept(bundles["none"], policy) == policy
  assert decoding.sink_token_kept(bundles["front"], parse_policy("dkv_cache")) == parse_policy("dkv_cache")
