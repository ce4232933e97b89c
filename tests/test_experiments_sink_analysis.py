"""experiments.sink_analysis end to end on tiny random checkpoints (LLaDA, MMaDA, Dream samplers and an ARM),
and the helpers it added to dlm_jax.analysis.sinks against brute-force loops."""

import json

import numpy as np
import pytest

from dlm_jax.analysis import sinks
from dlm_jax.instrument import sink_selection

try:
  from tests import experiments_fixtures as fx
except ImportError:
  import experiments_fixtures as fx


def test_relative_scores_matches_loop():
  rng = np.random.default_rng(0)
  c = rng.random((3, 2, 7)).astype(np.float32) * 3
  valid = rng.random((3, 2, 7)) > 0.3
  valid[0, 0] = False
  got = np.asarray(sinks.relative_scores(c, valid))
  for index in np.ndindex(3, 2):
    keys = np.flatnonzero(valid[index])
    want = np.zeros(7)
    if keys.size:
      want[keys] = c[index][keys] / c[index][keys].mean()
    np.testing.assert_allclose(got[index], want, rtol=1e-6)


def test_relative_scores_is_identity_for_full_bidirectional_maps():
  rng = np.random.default_rng(1)
  logits = rng.normal(size=(5, 5))
  probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
  np.testing.assert_allclose(np.asarray(sinks.relative_scores(probs.sum(0))), probs.sum(0), rtol=1e-5)


def test_sink_counts_over_epsilon_matches_epsilon_rule():
  rng = np.random.default_rng(2)
  c = rng.gamma(1.0, size=(4, 3, 9)).astype(np.float32) * 4
  valid = rng.random((4, 3, 9)) > 0.2
  epsilons = np.array([0.0, 0.5, 1.0, 3.0])
  got = sinks.sink_counts_over_epsilon(c, epsilons, valid)
  want = [int(np.asarray(sink_selection.epsilon_rule(c, e, "sum", valid)).sum()) for e in epsilons]
  np.testing.assert_array_equal(got, want)
  assert np.all(np.diff(got) <= 0)


def test_main_sink_disagreement():
  a = np.array([[[0, 5, 1], [3, 0, 0]], [[1, 1, 0], [0, 0, 2]]], float)  # [2, 2, 3]
  b = np.array([[[0, 9, 1], [0, 4, 0]], [[0, 1, 0], [0, 0, 7]]], float)
  active = np.array([[True, True], [False, True]])
  # argmax a: [[1, 0], [0, 2]]; b: [[1, 1], [1, 2]] -> differ at (0,1) and (1,0) (inactive)
  assert sinks.main_sink_disagreement(a, b, active) == (1, 3)


def test_step_sequences_diffusion_and_autoregressive():
  tokens = np.array([[7, 8, 20, 21, 22]])
  decode = np.array([[1, -1, 0]])
  got = sinks.step_sequences(tokens, decode, 2, 3, mask_id=99)
  np.testing.assert_array_equal(got[:, 0], [[7, 8, 99, 99, 99], [7, 8, 99, 99, 22], [7, 8, 20, 99, 22]])
  ar = sinks.step_sequences(tokens, np.array([[0, 1, 2]]), 2, 3, fill_id=-1)
  np.testing.assert_array_equal(ar[:, 0], [[7, 8, -1, -1, -1], [7, 8, 20, -1, -1], [7, 8, 20, 21, -1]])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  root = tmp_path_factory.mktemp("sink_analysis_ckpt")
  return {kind: fx.tiny_checkpoint(str(root / kind), kind, seed=i) for i, kind in enumerate(("dlm", "dream", "arm"))}


def test_sink_analysis_end_to_end(checkpoints, tmp_path):
  out = tmp_path / "out"
  entries = [f"llada={checkpoints['dlm']}", f"mmada={checkpoints['dlm']}", f"dream={checkpoints['dream']}",
             f"arm={checkpoints['arm']}"]
  result = fx.run_binary("sink_analysis", f"--checkpoints={','.join(entries)}", "--samplers=llada,mmada,dream,ar",
                         f"--output_dir={out}", "--n_prompts=3", "--batch_size=2", "--gen_length=8", "--steps=8",
                         "--block_length=4")
  assert "Most frequent sink tokens" in result.stdout
  records = fx.read_jsonl(out / "results.jsonl")
  assert sorted((r["model"], r["item"]) for r in records) == sorted(
      (m, str(i)) for m in ("llada", "mmada", "dream", "arm") for i in range(3))
  for r in records:
    assert len(r["nonsink_counts"]) == 41 and r["n_entries"] > 0
    assert 0.0 <= r["sink_fraction"] <= 1.0
    assert np.all(np.diff(r["nonsink_counts"]) >= 0)  # a larger ε leaves more non-sinks
    assert sum(r["score_histogram"]) == r["n_entries"]
  dlm = [r for r in records if r["model"] == "llada"]
  assert all(len(r["separate_sinks"]) == 2 for r in dlm)
  assert all("separate_sinks" not in r for r in records if r["model"] == "arm")
  summary = json.loads((out / "summary.json").read_text())
  assert set(summary["aggregates"]) == {"llada", "mmada", "dream", "arm"}
  assert len(summary["aggregates"]["llada"]["main_sink_grid"]) == 2  # layers
  for name in ("fig3_score_histogram.png", "fig10_nonsink_fraction.png", "summary.md"):
    assert (out / name).stat().st_size > 0
  for model in ("llada", "mmada", "dream", "arm"):
    for name in ("fig1_incoming_heatmap.png", "fig5_main_sink_grid.png", "fig7_largest_sink.png", "item_0.npz"):
      assert (out / model / name).stat().st_size > 0, (model, name)
  assert (out / "llada" / "fig6a_query_groups.png").exists()
  assert (out / "arm" / "prefill_incoming.png").exists()
  with np.load(out / "llada" / "item_0.npz") as data:
    assert data["layer_scores"].shape[:2] == (8, 2)  # steps, layers
    assert data["group_incoming"].shape[2] == 2
  # A second run finds everything done and rebuilds the same summary.
  again = fx.run_binary("sink_analysis", f"--checkpoints={','.join(entries)}", "--samplers=llada,mmada,dream,ar",
                        f"--output_dir={out}", "--n_prompts=3", "--batch_size=2", "--gen_length=8", "--steps=8",
                        "--block_length=4")
  assert len(fx.read_jsonl(out / "results.jsonl")) == len(records)
  assert json.loads((out / "summary.json").read_text())["aggregates"] == summary["aggregates"]
  assert "resuming with 3/3" in again.stderr


def test_sink_analysis_on_a_block_diffusion_mixture_of_experts(tmp_path):
  """A block-causal MoE checkpoint (LLaDA2.x layout) decodes with block diffusion in the binary."""
  directory = fx.tiny_checkpoint(str(tmp_path / "llada2"), "llada2")
  out = tmp_path / "out"
  fx.run_binary("sink_analysis", f"--checkpoints=moe={directory}", f"--output_dir={out}", "--n_prompts=2",
                "--batch_size=2", "--gen_length=6", "--layers=0,2")
  records = fx.read_jsonl(out / "results.jsonl")
  assert sorted(r["item"] for r in records) == ["0", "1"] and all(r["n_entries"] > 0 for r in records)
  model = json.loads((out / "summary.json").read_text())["models"][0]
  assert model["sampler"] == "block_diffusion" and model["settings"]["block_length"] == 4
  assert (out / "moe" / "fig5_main_sink_grid.png").stat().st_size > 0
  assert (out / "moe" / "fig_routing_sinks.png").stat().st_size > 0
  for r in records:  # layer 0 is dense: no routing slots; every MoE slot is a sink's or another token's
    sink, other = np.asarray(r["routing"]["sink_counts"]), np.asarray(r["routing"]["nonsink_counts"])
    assert sink[0].sum() == other[0].sum() == 0 and (sink[1] + other[1]).sum() > 0
  assert "## Routing of sinks" in (out / "summary.md").read_text()
