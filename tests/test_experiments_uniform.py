"""The experiment binaries on a uniform-state (DiffusionGemma-style) checkpoint: they pick its sampler,
decode what the library decodes for the same item key, and analyse the canvases its decoder steps read."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlm_jax.analysis import sinks
from dlm_jax.io import checkpoint
from dlm_jax.sampling import diffusion_gemma as dg
from experiments.common import decoding
from tests import experiments_fixtures as fx

GEN, CANVAS, STEPS = 8, 4, 3


@pytest.fixture(scope="module")
def uniform(tmp_path_factory):
  return fx.tiny_checkpoint(str(tmp_path_factory.mktemp("uniform") / "uniform"), "uniform")


@pytest.fixture(scope="module")
def runs(uniform, tmp_path_factory):
  """{case: (output path, exit code, stderr)}: every binary run of this file in one process
  (`experiments_fixtures.run_modules`: one start-up, and the programs the binaries share compiled once)."""
  root = tmp_path_factory.mktemp("uniform_runs")
  masking, analysis, generated, bad, norms = (root / name for name in ("masking", "analysis", "g", "bad", "norms"))
  cases = {  # name: (binary, its output, flags)
      "sink_masking_eval": ("sink_masking_eval", masking, [
          f"--checkpoints=u={uniform}", f"--output_dir={masking}", "--n_items=2", "--batch_size=2", "--mask_top_k=0,1",
          f"--gen_length={GEN}", f"--block_length={CANVAS}", f"--steps={STEPS}"]),
      "sink_analysis": ("sink_analysis", analysis, [
          f"--checkpoints=u={uniform}", f"--output_dir={analysis}", "--n_prompts=2", "--batch_size=2",
          f"--gen_length={GEN}", f"--block_length={CANVAS}", f"--steps={STEPS}"]),
      "generate": ("generate", generated, [
          f"--checkpoint={uniform}", "--prompt_ids=1,10,11,12", f"--gen_length={GEN}", f"--block_length={CANVAS}",
          f"--steps={STEPS}", "--seed=3", f"--json_out={generated / 'g.json'}", f"--stats_out={generated / 's.npz'}"]),
      "generate_ar": ("generate", bad, [f"--checkpoint={uniform}", "--prompt_ids=1,10", "--sampler=ar",
                                        f"--json_out={bad / 'bad.json'}"]),
      "generate_gen_length": ("generate", bad, [f"--checkpoint={uniform}", "--prompt_ids=1,10", "--gen_length=6",
                                                "--block_length=4", f"--json_out={bad / 'bad.json'}"]),
      "value_norms": ("value_norms", norms, [f"--checkpoints={uniform}", f"--output_dir={norms}", "--n_prompts=1"]),
  }
  generated.mkdir()
  bad.mkdir()
  done = fx.run_modules([(f"experiments.{binary}", flags) for binary, _, flags in cases.values()])
  return {name: (out, code or 0, stderr) for (name, (_, out, _)), (code, stderr, _) in zip(cases.items(), done)}


def _ok(run):
  out, code, stderr = run
  assert code == 0, stderr[-3000:]
  return out


def _library(directory: str, prompt_ids: list[int], item_id: str):
  config, params = checkpoint.load(directory)
  options = dg.DiffusionGemmaOptions(gen_length=GEN, canvas_length=CANVAS, max_denoising_steps=STEPS)
  return dg.generate(params, jnp.asarray([prompt_ids]), config=config, options=options,
                     key=decoding.batch_key(0, [item_id]))


def test_uniform_step_sequences():
  tokens = np.array([5, 6, 30, 31, 40, 41])
  canvases = np.array([[7, 8], [9, 10]])
  got = sinks.uniform_step_sequences(tokens, canvases, np.array([[2, 4], [4, 6]]))
  np.testing.assert_array_equal(got, [[5, 6, 7, 8, -1, -1], [5, 6, 30, 31, 9, 10]])


def test_sink_masking_eval_decodes_as_the_library(runs, uniform):
  out = _ok(runs["sink_masking_eval"])
  records = [r for r in fx.read_jsonl(out / "results.jsonl") if r["kind"] == "accuracy"]
  assert sorted((r["condition"], r["item"]) for r in records) == [(0, "0"), (0, "1"), (1, "0"), (1, "1")]
  for r in records:
    if r["condition"] == 0:  # unmasked: the library's tokens and decoder calls for the item's key
      trace = _library(uniform, r["prompt_ids"], r["item"])
      generated = np.asarray(trace.generated)[0].tolist()
      assert generated[:len(r["completion_ids"])] == r["completion_ids"]
      assert r["nfe"] == int(np.asarray(trace.row_nfe)[0])


def test_sink_analysis_reads_the_decoder_canvases(runs):
  out = _ok(runs["sink_analysis"])
  records = fx.read_jsonl(out / "results.jsonl")
  assert sorted(r["item"] for r in records) == ["0", "1"] and all(r["n_entries"] > 0 for r in records)
  summary = json.loads((out / "summary.json").read_text())
  assert summary["models"][0]["sampler"] == "diffusion_gemma"
  with np.load(out / "u" / "item_0.npz") as data:
    queries, valid, lp = data["computed_queries"], data["valid"], int(data["prompt_length"])
    steps = data["layer_scores"].shape[0]
  assert steps == records[0]["nfe"] and 0 < steps <= (GEN // CANVAS) * STEPS  # decoder steps only
  assert np.all(queries[:, 1] - queries[:, 0] == CANVAS) and np.all((queries[:, 0] - lp) % CANVAS == 0)
  positions = np.arange(valid.shape[1])[None, :]
  np.testing.assert_array_equal(valid, positions < queries[:, 1:])  # no key after the step's canvas counts
  for name in ("fig1_incoming_heatmap.png", "fig5_main_sink_grid.png", "fig6a_query_groups.png"):
    assert (out / "u" / name).stat().st_size > 0


def test_generate_cli_runs_the_uniform_sampler(runs, uniform):
  out = _ok(runs["generate"])
  result = json.loads((out / "g.json").read_text())
  config, params = checkpoint.load(uniform)
  options = dg.DiffusionGemmaOptions(gen_length=GEN, canvas_length=CANVAS, max_denoising_steps=STEPS)
  trace = dg.generate(params, jnp.asarray([[1, 10, 11, 12]]), config=config, options=options, key=jax.random.key(3))
  assert result["sampler"] == "diffusion_gemma" and result["tokens"] == np.asarray(trace.tokens)[0].tolist()
  assert result["nfe"] == int(trace.nfe)
  with np.load(out / "s.npz") as npz:
    assert npz["accepted"].shape == (int(trace.nfe), CANVAS)
    np.testing.assert_array_equal(npz["accepted"], np.asarray(trace.accepted)[:int(trace.nfe), 0])
  _, code, stderr = runs["generate_ar"]
  assert code == 1 and "does not fit a DiffusionGemma-style model; use diffusion_gemma" in stderr
  _, code, stderr = runs["generate_gen_length"]
  assert code == 1 and "multiple of canvas_length" in stderr and "Traceback" not in stderr


def test_value_norms_refuses_sliding_and_global_layers_in_one_line(runs):
  out, code, stderr = runs["value_norms"]
  assert code == 1 and "value norms are not available" in stderr and "Traceback" not in stderr
  assert not out.exists()
