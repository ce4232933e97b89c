"""The benchmark's PyTorch way runs the same algorithm as our sampler, and the benchmark runs end to end."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
import torch

from benchmarks import option_comparison, torch_way
from benchmarks.flops import step_flops
from dlm_jax import model
from dlm_jax.runtime import xla_cpu
from dlm_jax.config import ModelConfig
from dlm_jax.instrument.interventions import MaskPreviousSinks
from dlm_jax.sampling.llada import LLaDAOptions, generate
from dlm_jax.sampling.run_setup import RunSetup
from tests.experiments_fixtures import run_modules


REFUSALS = {"unknown_set": ["--xla_cpu_options=fastest"],
            "unknown_compare_set": ["--compare_xla_cpu_options=default,mkl"],
            "bad_query_chunk": ["--compare_xla_cpu_options=default", "--compare_query_chunks=128,big"]}


@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
  """{case: (exit code, stderr, whether its --json_out was written)} of the refused command lines, run in one
  process (`experiments_fixtures.run_modules`: flag parsing and `sys.exit("message")` as under `python -m`)."""
  out = tmp_path_factory.mktemp("refusals")
  done = run_modules([("benchmarks.denoise_bench", flags + [f"--json_out={out / name}.json"])
                      for name, flags in REFUSALS.items()])
  return {name: (code, stderr, (out / f"{name}.json").exists())
          for name, (code, stderr, _) in zip(REFUSALS, done)}


def test_torch_way_decodes_the_same_tokens_as_the_compiled_sampler():
  config = ModelConfig(name="bench", d_model=32, n_layers=2, n_heads=4, n_kv_heads=4, head_dim=8, mlp_hidden=96,
                       vocab_size=97, rope_theta=500000.0, rope_fp32=True, mask_token_id=96, eos_token_id=1)
  params = jax.tree.map(np.asarray, model.init_params(config, jax.random.key(0)))
  prompt = np.random.default_rng(0).integers(3, 96, size=(2, 6))
  options = LLaDAOptions(gen_length=8, steps=8, block_length=4)
  plain = generate(params, prompt, config=config, options=options)
  masked = generate(params, prompt, config=config, options=options,
                    setup=RunSetup(intervention=MaskPreviousSinks(top_k=1)))
  for attention, stats, mask, ours in [("sdpa", False, 0, plain), ("eager", True, 0, plain),
                                       ("eager_layer_bias", False, 1, masked)]:
    tokens, per_step = torch_way.generate(torch_way.build_model(params, config, attention), torch.as_tensor(prompt),
                                          gen_length=8, steps=8, block_length=4, mask_id=96, statistics=stats,
                                          mask_top_sinks=mask)
    np.testing.assert_array_equal(tokens.numpy(), np.asarray(ours.tokens))
    assert len(per_step) == (8 if stats else 0)


def test_step_flops_formula_counts_a_tiny_case_by_hand():
  # width 8, 2 heads (head dim 4), mlp 16, vocab 10, S = 3, window 2, one layer
  projections = 2 * 3 * 8 * 3 * 8 + 2 * 3 * 8 * 8
  mlp = 6 * 3 * 8 * 16
  attention = 4 * 3 * 3 * 8
  head = 2 * 2 * 8 * 10
  assert step_flops(8, 1, 2, 16, 10, 3, 2) == projections + mlp + attention + head


def test_benchmark_runs_end_to_end_and_writes_json(tmp_path):
  out = tmp_path / "bench.json"
  command = [sys.executable, "-m", "benchmarks.denoise_bench", "--widths=32", "--layers=1", "--heads=2",
             "--prompt_length=4", "--gen_length=8", "--block_length=4", "--vocab_size=64", "--memory_lengths=16",
             "--memory_width=32", "--xla_cpu_options=eigen", f"--json_out={out}"]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=600, env=env)
  assert done.returncode == 0, done.stderr[-3000:]
  results = json.loads(out.read_text())
  eigen = " ".join(xla_cpu.flag_entries("eigen"))
  assert results["xla_cpu_options"]["name"] == "eigen" and results["xla_cpu_options"]["xla_flags"] == eigen
  assert all(r["xla_flags"] == eigen for r in results["generation"] + results["step_memory"])  # the workers'
  assert results["cpu"] == dataclasses.asdict(xla_cpu.cpu_info())
  assert f"CPU: {results['cpu']['model']}" in done.stdout and f"XLA_FLAGS={eigen}" in done.stdout
  assert {(r["condition"], r["framework"]) for r in results["generation"]} == {
      (c, f) for c in ("off", "stats", "mask1") for f in ("jax", "torch")}
  assert all(r["ms_per_step"] > 0 and r["peak_fraction"] > 0 for r in results["generation"])
  assert len(results["step_memory"]) == 2 and "speedup" in done.stdout


def test_an_unknown_xla_cpu_option_set_is_a_one_line_error(refusals):
  code, stderr, written = refusals["unknown_set"]
  assert code == 1 and not written
  assert stderr.strip().splitlines() == [
      ("benchmarks.denoise_bench: error: --xla_cpu_options=fastest: unknown XLA CPU option set 'fastest'; "
       f"expected one of {', '.join(xla_cpu.CHOICES)}")]


def test_option_comparison_times_every_variant_and_the_torch_way_in_one_process(tmp_path):
  out = tmp_path / "compare.json"
  command = [sys.executable, "-m", "benchmarks.denoise_bench", "--compare_xla_cpu_options=eigen",
             "--compare_fused_projections", "--option_rounds=1", "--widths=32", "--layers=1", "--heads=2",
             "--prompt_length=4", "--gen_length=8", "--block_length=4", "--vocab_size=64", "--conditions=off",
             f"--json_out={out}"]
  done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  results = json.loads(out.read_text())
  rows = results["option_comparison"]
  assert [r["variant"] for r in rows] == ["eigen", "eigen/fused", "torch"]
  assert [v["name"] for v in results["variants"]] == ["eigen", "eigen/fused"]
  assert all(r["same_tokens"] and r["ms_per_step"] > 0 for r in rows)
  assert all("jax_speedup" in r for r in rows[:-1]) and results["sets"]["eigen"] == xla_cpu.OPTION_SETS["eigen"]
  assert results["cpu"] == dataclasses.asdict(xla_cpu.cpu_info()) and len(results["load_average"]) == 3
  assert f"CPU: {results['cpu']['model']}" in done.stdout


def test_comparison_variants_are_every_combination_named_by_what_differs():
  names = [v["name"] for v in option_comparison.variants(["default", "eigen"], [128, 256], [False, True])]
  assert names == [f"{s}/qc{c}{f}" for f in ("", "/fused") for c in (128, 256) for s in ("default", "eigen")]
  assert option_comparison.variants(["onednn"], [256], [False]) == [
      {"name": "onednn", "set": "onednn", "query_chunk": 256, "fused": False}]


def test_an_unknown_set_to_compare_is_a_one_line_error(refusals):
  code, stderr, written = refusals["unknown_compare_set"]
  assert code == 1 and not written
  assert stderr.strip().splitlines() == [
      ("benchmarks.denoise_bench: error: --compare_xla_cpu_options: unknown set 'mkl'; expected some of "
       f"{', '.join(xla_cpu.OPTION_SETS)}")]


def test_a_bad_query_chunk_to_compare_is_a_one_line_error(refusals):
  code, stderr, written = refusals["bad_query_chunk"]
  assert code == 1 and not written
  assert stderr.strip().splitlines() == [
      "benchmarks.denoise_bench: error: --compare_query_chunks=128,big: expected positive integers"]
