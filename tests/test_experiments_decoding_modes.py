"""--decoding in the binaries: the modes and their sampler options, one-line errors, experiments.generate in
a cached threshold mode against the library, the analysis binaries reading only each row's decoded steps
(the same per-item results at two batch sizes while rows wait), the comparison binary, and the
decoding-modes benchmark in a tiny configuration."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from dlm_jax.io import checkpoint
from dlm_jax.sampling import llada
from dlm_jax.sampling.dream import diffusion_generate, elastic_cache_options
from dlm_jax.session import SessionError, decoding_mode
from dlm_jax.session.decoding_mode import DecodingMode
from experiments.common import validity

try:
  from tests import experiments_fixtures as fx
except ImportError:
  import experiments_fixtures as fx

SMALL = ["--gen_length=8", "--steps=8", "--block_length=4"]
FAST = ["--decoding=threshold_dual_cache", "--threshold=0.1"]  # rows of the random tiny model finish apart


def test_modes_map_to_sampler_options():
  mode = decoding_mode.from_values("threshold_dual_cache", threshold=0.8, factor=2.0)
  assert mode == DecodingMode("threshold_dual_cache", threshold=0.8)
  assert mode.option_fields("llada") == {"threshold": 0.8, "factor": None, "cache": "dual"}
  assert mode.record() == {"decoding": "threshold_dual_cache", "threshold": 0.8}
  assert DecodingMode.from_record(mode.record()) == mode and mode.spec == "threshold_dual_cache:0.8"
  assert decoding_mode.from_values("factor").option_fields("mmada") == {"threshold": None, "factor": 1.0,
                                                                          "cache": "none"}
  assert decoding_mode.from_values("prefix_cache").option_fields("llada")["cache"] == "prefix"
  assert decoding_mode.from_values("exact", threshold=0.5) == DecodingMode()
  assert mode.option_fields("dream") == {"threshold": 0.8, "factor": None, "cache": "dual"}
  assert mode.option_fields("ar") == {}
  assert decoding_mode.from_spec("threshold:0.7") == DecodingMode("threshold", threshold=0.7)
  assert decoding_mode.from_spec("dual_cache") == DecodingMode("dual_cache")
  for name in decoding_mode.MODES:
    options = llada.LLaDAOptions(gen_length=8, steps=8, block_length=4,
                                 **decoding_mode.from_values(name).option_fields("llada"))
    assert options.blockwise == (name != "exact")


@pytest.mark.parametrize("call, words", [
    (lambda: decoding_mode.from_values("fast"), ["--decoding=fast", "threshold_dual_cache"]),
    (lambda: decoding_mode.from_values("threshold", threshold=1.5), ["--threshold=1.5", "[0, 1]"]),
    (lambda: decoding_mode.from_values("exact", threshold=-0.1), ["--threshold=-0.1"]),
    (lambda: decoding_mode.from_values("factor", factor=0.0), ["--factor=0.0"]),
    (lambda: decoding_mode.from_values("dual_cache").check_guidance(1.0), ["--cfg_scale=1"]),
    (lambda: decoding_mode.from_spec("exact:0.5"), ["exact:0.5"]),
])
def test_bad_values_are_one_line_errors_naming_the_flag(call, words):
  with pytest.raises(SessionError) as error:
    call()
  assert "\n" not in str(error.value) and all(w in str(error.value) for w in words), str(error.value)


def test_decoded_steps_are_the_rows_steps_among_those_run():
  active = np.array([[1, 1], [1, 0], [0, 1], [1, 1], [0, 0]], bool)  # [max_steps, B]
  np.testing.assert_array_equal(validity.decoded_steps(4, active, 0), [0, 1, 3])
  np.testing.assert_array_equal(validity.decoded_steps(3, active, 1), [0, 2])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  root = tmp_path_factory.mktemp("decoding_ckpt")
  return {kind: fx.tiny_checkpoint(str(root / kind), kind, seed=i) for i, kind in enumerate(("dlm", "dream"))}


def test_generate_in_a_cached_threshold_mode(checkpoints, tmp_path):
  out, stats = tmp_path / "g.json", tmp_path / "g.npz"
  base = [f"--checkpoint={checkpoints['dlm']}", f"--json_out={out}", "--prompt_ids=5,9,7,12", *SMALL]
  dream = [f"--checkpoint={checkpoints['dream']}", f"--json_out={out}", "--prompt_ids=5,9,7,12", "--gen_length=8",
           "--steps=8", "--sampler=dream"]
  cases = [base + ["--decoding=fast"], base + ["--decoding=threshold", "--threshold=1.5"],
           base + ["--decoding=dual_cache", "--cfg_scale=1"], dream + ["--decoding=dual_cache", "--block_length=4"],
           base + ["--decoding=threshold_dual_cache", f"--stats_out={stats}"],
           dream + ["--decoding=threshold_dual_cache", "--block_length=4", f"--json_out={tmp_path / 'd.json'}"],
           dream + ["--decoding=threshold", "--window=2", "--eos_truncation", f"--json_out={tmp_path / 'w.json'}"]]
  results = fx.run_cases("generate", cases)
  for (code, stderr), words in zip(results[:4], (["--decoding=fast"], ["--threshold=1.5"], ["--cfg_scale"],
                                                  ["origin", "block_length"])):
    lines = stderr.strip().splitlines()
    assert code == 1 and len(lines) == 1 and all(w in lines[0] for w in words), stderr
  assert results[4][0] == 0, results[4][1]
  assert results[5][0] == 0, results[5][1]
  dream_result = json.loads((tmp_path / "d.json").read_text())
  assert dream_result["decoding"] == "threshold_dual_cache:0.9" and dream_result["nfe"] <= 8
  assert results[6][0] == 0, results[6][1]  # Elastic-Cache's Dream decoding: no blocks
  windowed = json.loads((tmp_path / "w.json").read_text())
  config, params = checkpoint.load(checkpoints["dream"])
  trace = diffusion_generate(params, np.asarray([[5, 9, 7, 12]]), config=config,
                             options=elastic_cache_options(gen_length=8, steps=8, window=2))
  assert windowed["tokens"] == np.asarray(trace.tokens)[0].tolist() and windowed["nfe"] == int(trace.nfe)
  assert {k: windowed["settings"]["decoding"][k] for k in ("window", "eos_truncation")} == {
      "window": 2, "eos_truncation": True}
  result = json.loads(out.read_text())
  config, params = checkpoint.load(checkpoints["dlm"])
  trace = llada.generate(params, np.asarray([[5, 9, 7, 12]]), config=config,
                         options=llada.LLaDAOptions(gen_length=8, steps=8, block_length=4, threshold=0.9,
                                                    cache="dual"))
  assert result["tokens"] == np.asarray(trace.tokens)[0].tolist()
  assert result["decoding"] == "threshold_dual_cache:0.9" and result["settings"]["decoding"]["threshold"] == 0.9
  assert result["nfe"] == result["row_nfe"] == int(trace.nfe) <= 8  # two blocks of a refresh and <= 3 steps
  with np.load(stats) as data:
    incoming, queries = data["incoming_attention"], data["computed_queries"]
  assert incoming.shape == (result["nfe"], config.n_layers, config.n_heads, 12) and queries.shape == (result["nfe"], 2)
  assert np.all(incoming.sum(axis=(1, 2, 3)) > 0)  # no zero-padded step
  refresh = np.all(queries == [0, 12], axis=1)
  assert refresh.sum() == 2 and set(map(tuple, queries[~refresh])) <= {(4, 8), (8, 12)}


def test_analysis_binaries_and_comparison_in_a_threshold_cache_mode(checkpoints, tmp_path):
  dlm = f"--checkpoints=dlm={checkpoints['dlm']}"
  common = [dlm, "--n_prompts=2", *SMALL]
  exact, fast, alone = tmp_path / "exact", tmp_path / "fast", tmp_path / "alone"
  results = fx.run_cases("sink_analysis", [
      common + ["--decoding=bogus", f"--output_dir={tmp_path / 'never'}"],
      common + ["--batch_size=2", f"--output_dir={exact}/sink_analysis"],
      common + [*FAST, "--batch_size=2", f"--output_dir={fast}/sink_analysis"],
      common + [*FAST, "--batch_size=1", f"--output_dir={alone}"]])
  assert results[0][0] == 1 and "--decoding=bogus" in results[0][1] and not (tmp_path / "never").exists()
  assert [code for code, _ in results[1:]] == [0, 0, 0], results
  batched, single = (fx.read_jsonl(d / "results.jsonl") for d in (fast / "sink_analysis", alone))
  assert [r["nfe"] for r in batched] == [r["nfe"] for r in single]  # waiting steps are not the row's
  assert len({r["nfe"] for r in batched}) == 2  # one row of the batch waited for the other
  for a, b in zip(batched, single):
    np.testing.assert_allclose(a["score_histogram"], b["score_histogram"])
    assert a["token_counts"] == b["token_counts"] and a["modal_largest_sink"] == b["modal_largest_sink"]
  with np.load(fast / "sink_analysis" / "dlm" / "item_0.npz") as data:
    assert data["layer_scores"].shape[0] == len(data["step_index"]) == batched[0]["nfe"]
    assert np.all(data["layer_scores"].sum(axis=(1, 2)) > 0) and np.all(np.diff(data["step_index"]) > 0)
    assert data["computed_queries"].shape == (batched[0]["nfe"], 2)
  summary = (fast / "sink_analysis" / "summary.md").read_text()
  assert "cached keys included" in summary and "decoding=threshold_dual_cache" in summary
  masking = fx.run_cases("sink_masking_eval", [[dlm, "--n_items=2", "--batch_size=2", "--mask_top_k=0,1",
                                                *FAST, *SMALL,
                                                f"--output_dir={fast}/sink_masking_eval"]])
  assert masking[0][0] == 0, masking
  table = json.loads((fast / "sink_masking_eval" / "table.json").read_text())
  assert table["accuracy"]["dlm"]["1"]["mean_nfe"] > 0
  out = tmp_path / "comparison"
  done = fx.run_binary("decoding_comparison", f"--runs={exact},{fast}", f"--output_dir={out}")
  assert "threshold_dual_cache:0.1" in done.stdout
  compared = json.loads((out / "comparison.json").read_text())
  assert [m["mode"] for m in compared["modes"]] == ["exact", "threshold_dual_cache:0.1"]
  assert compared["modes"][0]["sinks"]["same_modal_sink"] == 1.0 and "masking" in compared["modes"][1]
  assert (out / "decoding_modes.png").stat().st_size > 0 and (out / "comparison.md").exists()


def test_benchmark_tiny_configuration(checkpoints, tmp_path):
  out = tmp_path / "bench.json"
  done = subprocess.run([sys.executable, "-m", "benchmarks.decoding_modes_bench", f"--checkpoint={checkpoints['dlm']}",
                         "--n=2", "--batch_size=2", "--modes=exact,threshold_dual_cache:0.9", *SMALL,
                         f"--json_out={out}"], cwd=fx.ROOT, capture_output=True, text=True, timeout=600,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert done.returncode == 0, done.stderr[-3000:]
  report = json.loads(out.read_text())
  assert "CPU:" in done.stdout and report["machine"]["cpu"]
  rows = {(r["mode"], r["statistics"]): r for r in report["results"]}
  assert set(rows) == {(m, s) for m in ("exact", "threshold_dual_cache:0.9") for s in (False, True)}
  assert rows[("exact", False)]["mean_row_nfe"] == 8 and rows[("exact", False)]["ratio_to_exact"] == 1.0
  assert rows[("threshold_dual_cache:0.9", True)]["accuracy"] == rows[("threshold_dual_cache:0.9", False)]["accuracy"]
  assert "stats_cost" in rows[("exact", True)] and "speedup" in report["targets"]


def test_nvlabs_variants_map_to_sampler_options():
  """--decoding=factor is NVlabs' rule (the samplers' default), factor_dllm dllm's; --dual_cache_forwards
  reaches LLaDA's options with a dual cache only, and is recorded."""
  assert decoding_mode.from_values("factor").option_fields("llada") == {"threshold": None, "factor": 1.0,
                                                                          "cache": "none"}
  assert llada.LLaDAOptions(factor=1.0).factor_rule == "fast_dllm"
  dllm = decoding_mode.from_values("factor_dllm", factor=2.0)
  assert dllm.option_fields("llada")["factor_rule"] == "dllm" and dllm.option_fields("dream")["factor_rule"] == "dllm"
  assert DecodingMode.from_record(dllm.record()) == dllm
  capped = decoding_mode.from_values("threshold_dual_cache", dual_cache_forwards="steps_per_block")
  assert capped.record()["dual_cache_forwards"] == "steps_per_block"
  assert DecodingMode.from_record(capped.record()) == capped
  options = llada.LLaDAOptions(gen_length=8, steps=4, block_length=4, **capped.option_fields("llada"))
  assert options.dual_cache_forwards == "steps_per_block"
  with pytest.raises(SessionError, match="--dual_cache_forwards=steps_per_block applies to the dual-cache modes"):
    decoding_mode.from_values("prefix_cache", dual_cache_forwards="steps_per_block")
  with pytest.raises(SessionError, match="--dual_cache_forwards=some"):
    decoding_mode.from_values("dual_cache", dual_cache_forwards="some")
