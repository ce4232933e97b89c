"""The compute-policy benchmark (`benchmarks.policy_bench`): its schedules count each method's calls as the
methods' rules say (counted here by hand), its call classification reads a run's Trace as the policies record
it, and a tiny run measures every call with XLA's count within 10% of the analytic one (no timing assertions:
the speed goals are read from the benchmark's printed figures). The binary's cases run in two processes
(`run_modules`): every case in the first, the one reading a file written from the first's results in the second."""

import json
import types

import numpy as np
import pytest

from benchmarks import policy_call_mix, policy_schedules
from dlm_jax.policy.registry import parse_policy

try:
  from tests.experiments_fixtures import run_modules
except ImportError:  # tests/ on sys.path (pytest's rootdir insertion)
  from experiments_fixtures import run_modules


def test_exact_decoding_schedules_at_the_8b_layout():
  mixes = policy_schedules.exact_decoding(256, 32, 8, parse_policy("sparsed"), parse_policy("dllm_cache"),
                                          (32, 64, 128, 256))
  assert mixes["exact"] == {"exact": 1.0}
  assert mixes["dual_cache"] == pytest.approx({"full": 1 / 32, "dual_cache": 31 / 32})
  # per block full at steps 0, 1, 8, 16, 24; block k's 27 cached calls compute 256 − 32k − i + 1 positions (step i):
  # blocks 0-3 more than 128, blocks 4 and 5 65 to 127, block 6 34 to 63, block 7 2 to 31
  assert mixes["dkv_cache"] == pytest.approx({"full": 40 / 256, "dkv_subset": 4 * 27 / 256,
                                              "dkv_subset/2": 2 * 27 / 256, "dkv_subset/4": 27 / 256,
                                              "dkv_subset/8": 27 / 256})
  assert mixes["sparse_dllm"] == pytest.approx({"full": 2 / 32, "sparse_subset": 30 / 32})
  assert mixes["sparse_dllm_dual_cache"] == pytest.approx({"full": 1 / 32, "dual_cache": 1 / 32,
                                                           "sparse_subset": 30 / 32})
  assert mixes["sparsed"] == pytest.approx({"full": 53 / 256, "sparsed_blocks": 203 / 256})  # E = 52: steps 0..52
  # prompt every 50 calls (0, 50, ..., 250), response every 7 (0, 7, ..., 252): both at call 0 only
  assert mixes["dllm_cache"] == pytest.approx({"reuse_both": 1 / 256, "reuse_prompt": 5 / 256, "reuse_gen": 36 / 256,
                                               "reuse_none": 214 / 256})
  assert policy_schedules.measured("full", {"a": 0.5, "full": 0.5}, 4) == pytest.approx({"a": 0.375, "full": 0.625})
  # a one-block threshold mix on 8 blocks: each block's cached calls at the bucket of its largest count
  assert policy_schedules.dkv_by_block({"full": 0.36, "dkv_subset": 0.64}, 256, 32, (32, 64, 128, 256)) == \
      pytest.approx({"full": 0.36, "dkv_subset": 0.32, "dkv_subset/2": 0.16, "dkv_subset/4": 0.08,
                     "dkv_subset/8": 0.08})
  assert [policy_schedules.dkv_call((3, 5, 9), n) for n in (1, 3, 4, 9)] == [
      "dkv_subset/4", "dkv_subset/4", "dkv_subset/2", "dkv_subset"]


def _trace(computed=None, keys=None, record=None):
  """A one-row Trace stand-in: computed [steps, S] bool, keys [steps], record (leading steps axis, row axis added)."""
  add_row = lambda x: None if x is None else np.asarray(x)[:, None]  # noqa: E731
  record = {k: add_row(v) for k, v in record.items()} if isinstance(record, dict) else add_row(record)
  return types.SimpleNamespace(computed_positions=add_row(computed), keys_read=add_row(keys), policy_record=record)


def test_calls_are_classified_from_the_trace():
  s, p, layers = 6, 2, 4
  everything, some = np.ones(s, bool), np.array([0, 0, 1, 1, 0, 0], bool)
  classify = policy_call_mix.classify
  assert classify("none", _trace(), 0, s, p, layers) == {"exact": 1.0}
  run = _trace(computed=[everything, some])
  assert [classify("dkv_cache", run, i, s, p, layers) for i in (0, 1)] == [{"full": 1.0}, {"dkv_subset": 1.0}]
  assert classify("sparse_dllm", run, 1, s, p, layers) == {"sparse_subset": 1.0}
  cached = _trace(computed=[everything, some, some], keys=[s, s, s - 2])  # with the dual cache: call 1 reads all keys
  assert [classify("sparse_dllm", cached, i, s, p, layers) for i in range(3)] == [
      {"full": 1.0}, {"dual_cache": 1.0}, {"sparse_subset": 1.0}]
  run = _trace(computed=[everything, everything], keys=[s, s - 2])
  assert [classify("sparsed", run, i, s, p, layers) for i in (0, 1)] == [{"full": 1.0}, {"sparsed_blocks": 1.0}]
  layer0 = np.ones((1, s), bool)
  prompt_only = np.concatenate([layer0, np.tile([[1, 1, 0, 0, 0, 0]], (layers - 1, 1)).astype(bool)])
  adaptive = np.concatenate([layer0, np.tile([[0, 0, 1, 0, 0, 1]], (layers - 1, 1)).astype(bool)])
  run = _trace(computed=[everything] * 3, record=[np.ones((layers, s), bool), prompt_only, adaptive])
  assert [classify("dllm_cache", run, i, s, p, layers) for i in range(3)] == [
      {"reuse_both": 1.0}, {"reuse_prompt": 1.0}, {"reuse_none": 1.0}]
  run = _trace(computed=[everything, some, some], record={"refresh_start": [0, 1, layers], "queries": [[0]] * 3})
  assert [classify("elastic_cache", run, i, s, p, layers) for i in range(3)] == [
      {"elastic_full_refresh": 1.0, "elastic_no_refresh": 0.0},
      {"elastic_full_refresh": 0.75, "elastic_no_refresh": 0.25},
      {"elastic_full_refresh": 0.0, "elastic_no_refresh": 1.0}]
  run = _trace(computed=[everything, some, some], record={"rows": [s, 3, 6], "count": [s, 2, 4],
                                                          "overflow": [False] * 3})
  assert [classify("d2cache", run, i, s, p, layers, (2, 3, 6)) for i in range(3)] == [
      {"full": 1.0}, {"d2cache_S/2": 1.0}, {"d2cache_S/1": 1.0}]


BENCH = "benchmarks.policy_bench"
FLAGS = ["--preset=tiny-llada", "--repeats=1", "--prompt_lengths=16", "--gen_length=64", "--block_length=16",
         "--mix_prompts=0", "--sparsed=sparsed:block_size=16", "--elastic_cache=elastic_cache:window_length=16"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """(directory, {case: (exit code, stderr, stdout)}): the benchmark's cases in one process (`run_modules`), then
  the one that reads "old.json" (bench.json less a call, written between the two) in a second."""
  d = tmp_path_factory.mktemp("policy_bench")
  cases = {"refused": [f"--json_out={d / 'refused.json'}", "--elastic_cache=elastic_cache:window_length=8"],
           "bench": [f"--json_out={d / 'bench.json'}"],
           "again": [f"--json_out={d / 'again.json'}", f"--calls_from={d / 'bench.json'}"],
           "other": [f"--json_out={d / 'other.json'}", f"--calls_from={d / 'bench.json'}", "--gen_length=128"]}
  done = dict(zip(cases, run_modules([(BENCH, FLAGS + flags) for flags in cases.values()])))
  if done["bench"][0] == 0:  # a run from before dKV-Cache's buckets: refused, not half-reused
    results = json.loads((d / "bench.json").read_text())
    for prompt in results["prompts"].values():
      del prompt["calls"]["dkv_subset/2"]
    (d / "old.json").write_text(json.dumps(results))
    old = [f"--json_out={d / 'old_out.json'}", f"--calls_from={d / 'old.json'}"]
    done["old"], = run_modules([(BENCH, FLAGS + old)])
  return d, done


def test_every_call_is_measured_and_counted(runs):
  d, done = runs
  code, stderr, stdout = done["bench"]
  assert code == 0, stderr[-3000:]
  results = json.loads((d / "bench.json").read_text())
  assert f"CPU: {results['cpu']}" in stdout
  calls = results["prompts"]["16"]["calls"]
  assert set(calls) == {"exact", "full", "dkv_subset", "dkv_subset/2", "dkv_subset/4", "dkv_subset/8",
                        "sparse_subset", "dual_cache", "sparsed_blocks", "reuse_none", "reuse_gen", "reuse_prompt",
                        "reuse_both", "elastic_no_refresh", "elastic_full_refresh", "d2cache_S/1", "d2cache_S/2",
                        "d2cache_S/4", "d2cache_S/8"}
  for name, call in calls.items():
    assert call["ms"] > 0
    assert call["xla_flops_check"] == pytest.approx(call["analytic_flops_check"], rel=0.1), name
  assert calls["sparse_subset"]["flops"] < calls["dual_cache"]["flops"] < calls["dkv_subset"]["flops"] < \
      calls["full"]["flops"]
  assert calls["dkv_subset/8"]["flops"] < calls["dkv_subset/4"]["flops"] < calls["dkv_subset/2"]["flops"] < \
      calls["dkv_subset"]["flops"]  # G = 64 and its halves
  assert calls["reuse_none"]["flops"] < calls["reuse_gen"]["flops"] < calls["reuse_both"]["flops"]
  assert calls["elastic_no_refresh"]["flops"] < calls["elastic_full_refresh"]["flops"]
  steps = results["prompts"]["16"]["exact_decoding"]
  assert set(steps) == {"exact", "dual_cache", "dkv_cache", "sparse_dllm", "sparse_dllm_dual_cache", "sparsed",
                        "dllm_cache"}  # no tiny-dlm mixes
  assert "threshold_decoding" not in results["prompts"]["16"]

  # --calls_from: the same figures from the first run's calls, without timing anything again
  code, stderr, stdout = done["again"]
  assert code == 0, stderr[-3000:]
  again = json.loads((d / "again.json").read_text())
  assert again["prompts"]["16"]["calls"] == calls
  assert again["prompts"]["16"]["exact_decoding"] == steps
  assert again["calls_from"] == {"cpu": results["cpu"], "load_average_start": results["load_average_start"],
                                 "load_average_end": results["load_average_end"], "path": str(d / "bench.json")}
  assert " S=" not in stdout  # no call timed
  code, stderr, _ = done["other"]
  assert code == 1
  assert stderr.strip().splitlines() == [
      f"benchmarks.policy_bench: error: --calls_from={d / 'bench.json'}: its gen_length is 64, this run's 128"]
  assert not (d / "other.json").exists()
  code, stderr, _ = done["old"]
  assert code == 1
  assert stderr.strip().splitlines() == [
      f"benchmarks.policy_bench: error: --calls_from={d / 'old.json'}: no dkv_subset/2 measured at prompt 16 "
      "(a run from before dKV-Cache's row buckets); run without --calls_from"]
  assert not (d / "old_out.json").exists()


def test_a_policy_the_layout_refuses_is_one_line(runs):
  d, done = runs
  code, stderr, _ = done["refused"]
  assert code == 1
  assert stderr.strip().splitlines() == [
      "benchmarks.policy_bench: error: elastic_cache:window_length=8 at prompt 16 + 64 in blocks of 16: "
      "elastic_cache window_length=8 is shorter than the sampler's block_length=16: the candidates would not be "
      "computed; use window_length >= 16 or block_caching=false."]
  assert not (d / "refused.json").exists()
