"""The statistics-overhead benchmark of the compute policies and decoding rules (`benchmarks.policy_stats_bench`):
it times every (policy or rule, statistics) pair it was given and records the overhead from the medians it
printed; bad flags are one line before any model work, every case in one process (no timing assertions: the
goal is read from the printed figures)."""

import json

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
PAIRS = ["--policies=none,sparse_dllm:keep_ratio=0.5",
         "--rules=eb:gamma=0.5,klass:kl_threshold=0.02+kl_history_length=3"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """(directory, [(exit code, stderr, stdout)]): every REFUSALS case, case i writing (or not) directory /
  f"stats{i}.json", then the timed run of PAIRS writing directory / "stats.json", all in one process."""
  directory = tmp_path_factory.mktemp("stats_bench")
  cases = [[*SMALL, f"--json_out={directory}/stats{i}.json", flag] for i, (flag, _) in enumerate(REFUSALS)]
  cases.append([*SMALL, f"--json_out={directory}/stats.json", *PAIRS])
  return directory, run_modules([("benchmarks.policy_stats_bench", flags) for flags in cases])


def test_every_pair_is_timed_and_the_overhead_is_their_ratio(runs):
  directory, cases = runs
  code, stderr, stdout = cases[len(REFUSALS)]
  assert code == 0, stderr[-3000:]
  results = json.loads((directory / "stats.json").read_text())
  assert f"CPU: {results['cpu']}" in stdout
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
    assert f"{text:28s} {row['ms_per_step_off']:8.2f} ms/step without statistics" in stdout


@pytest.mark.parametrize("case", range(len(REFUSALS)))
def test_bad_flags_are_one_line(runs, case):
  directory, results = runs
  code, stderr, _ = results[case]
  assert code == 1
  lines = stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(f"benchmarks.policy_stats_bench: error: {REFUSALS[case][1]}"), lines
  assert not (directory / f"stats{case}.json").exists()
