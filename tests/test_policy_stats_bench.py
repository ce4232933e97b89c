"""The statistics-overhead benchmark of the compute policies and decoding rules (`benchmarks.policy_stats_bench`):
it times every (policy or rule, statistics) pair it was given and records the overhead from the medians it
printed; bad flags are one line before any model work, every refusal in one process (no timing assertions: the
goal is read from the printed figures)."""

import json
import os
import subprocess
import sys

import pytest

try:
  from tests.experiments_fixtures import run_modules
except ImportError:  # tests/ on sys.path (pytest's rootdir insertion)
  from experiments_fixtures import run_modules

SMALL = ["--width=32", "--layers=1", "--heads=2", "--vocab_size=64", "--prompt_length=8", "--gen_length=16",
         "--block_length=8", "--rounds=2"]
REFUSALS = [
    ("--policies=sparse_dllm:keep_ratio=2", "--policies: sparse_dllm:keep_ratio=2: "),
    ("--block_length=5", "--block_length=5: expected a divisor of --gen_length=16"),
    ("--rules=klass:kl_history_length=0", "--rules: klass:kl_history_length=0: "),
    ("--rules=eb:gamma", "--rules: eb:gamma: decoding mode 'eb:gamma': expected name:knob=value"),
    ("--rules=beam", "--rules: beam: expected a decoding rule, one of eb, klass"),
]


def _bench(tmp_path, *flags):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  return subprocess.run([sys.executable, "-m", "benchmarks.policy_stats_bench", *SMALL,
                         f"--json_out={tmp_path / 'stats.json'}", *flags],
                        capture_output=True, text=True, check=False, timeout=600, env=env)


@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
  """(directory, [(exit code, stderr, stdout)]) of every REFUSALS case, run in one process, case i writing (or
  not) directory / f"stats{i}.json"."""
  directory = tmp_path_factory.mktemp("refusals")
  return directory, run_modules([("benchmarks.policy_stats_bench", [*SMALL, f"--json_out={directory}/stats{i}.json",
                                                                    flag]) for i, (flag, _) in enumerate(REFUSALS)])


def test_every_pair_is_timed_and_the_overhead_is_their_ratio(tmp_path):
  done = _bench(tmp_path, "--policies=none,sparse_dllm:keep_ratio=0.5",
                "--rules=eb:gamma=0.5,klass:kl_threshold=0.02+kl_history_length=3")
  assert done.returncode == 0, done.stderr[-3000:]
  results = json.loads((tmp_path / "stats.json").read_text())
  assert f"CPU: {results['cpu']}" in done.stdout
  assert set(results["policies"]) == {"none", "sparse_dllm:keep_ratio=0.5"}
  assert set(results["rules"]) == {"eb:gamma=0.5", "klass:kl_threshold=0.02+kl_history_length=3"}
  for text, row in {**results["policies"], **results["rules"]}.items():
    assert {c: len(r) for c, r in row["runs_s"].items()} == {"off": 2, "stats": 2}
    assert min(row["runs_s"]["off"] + row["runs_s"]["stats"]) > 0
    calls = row["model_calls"]  # exact decoding: one call per token; a rule's own count (EB at γ 0.5: fewer)
    assert calls == 16 if text in results["policies"] else 1 <= calls <= 16
    # the median of two runs is their mean, per model call
    assert row["ms_per_step_off"] == pytest.approx(sum(row["runs_s"]["off"]) / 2 * 1e3 / calls)
    assert row["ms_per_step_stats"] == pytest.approx(sum(row["runs_s"]["stats"]) / 2 * 1e3 / calls)
    assert row["stats_overhead"] == pytest.approx(row["ms_per_step_stats"] / row["ms_per_step_off"] - 1)
    assert f"{text:28s} {row['ms_per_step_off']:8.2f} ms/step without statistics" in done.stdout


@pytest.mark.parametrize("case", range(len(REFUSALS)))
def test_bad_flags_are_one_line(refusals, case):
  directory, results = refusals
  code, stderr, _ = results[case]
  assert code == 1
  lines = stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(f"benchmarks.policy_stats_bench: error: {REFUSALS[case][1]}"), lines
  assert not (directory / f"stats{case}.json").exists()
