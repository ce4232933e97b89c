"""Summarises a profiled suite run (`DLM_JAX_SUITE_PROFILE=DIR python -m pytest ...`): one row per test file.

Usage: `python tests/profiling/report.py DIR [--json OUT.json] [--costs tests/file_costs.json [--measured TEXT]]`:
prints the table; `--json` writes it; `--costs` writes each file's CPU seconds (worker + subprocesses), the order
in which `tests/conftest.py` starts the files, with `--measured TEXT` saying which run they come from (the
profile's directory is not written: it is a path on one machine). Columns (seconds unless said):
tests; wall (sum of the file's test walls, fixtures included); cpu (the worker's CPU) and sub_cpu (its
subprocesses'); compile (XLA backend compilation, in the worker and in subprocesses) and trace (tracing and
lowering to MLIR); programs (backend compilations), hits (programs loaded from the persistent cache), again
(compilations of a program compiled before in this run, by this process before `jax.clear_caches()` or by
another process: the persistent cache did not hold it) and again_s (their compile seconds); procs
(subprocesses), startup (their seconds from start to the first JAX trace, or to exit when they never trace)
and startup_cpu (their CPU seconds by then).
"""

from __future__ import annotations

import collections
import glob
import json
import os
import sys


def _file_of(test: str | None) -> str:
  return test.split("::")[0] if test else "(outside tests)"


def summarise(directory: str) -> dict[str, dict[str, float]]:
  """Reads every `<pid>.jsonl` of a profiled run; returns {test file: {column: value}}."""
  rows: dict[str, dict[str, float]] = collections.defaultdict(lambda: collections.defaultdict(float))
  keyed: list[tuple[float, str, str, str, float]] = []
  for path in sorted(glob.glob(os.path.join(directory, "*.jsonl"))):
    pid = os.path.basename(path).split(".")[0]
    with open(path, encoding="utf-8") as f:
      records = [json.loads(line) for line in f if line.strip()]
    for r in records:
      row = rows[_file_of(r.get("nodeid") or r.get("test"))]
      kind = r["kind"]
      if kind == "test":
        row["tests"] += 1
        row["wall"] += r["wall"]
        row["cpu"] += r["cpu"]
        row["sub_cpu"] += r["children_cpu"]
      elif kind == "jax":
        if r["event"] == "compile":
          row["compile"] += r["secs"]
          row["programs"] += 1
          if r.get("key"):
            keyed.append((r["t"], r["key"], pid, _file_of(r.get("test")), r["secs"]))
        else:
          row["trace"] += r["secs"]
      elif kind == "cache_hit":
        row["hits"] += 1
      elif kind == "exit":
        row["procs"] += 1
        row["startup"] += r["first_trace_at"] if r["first_trace_at"] is not None else r["wall"]
        row["startup_cpu"] += r.get("first_trace_cpu") or r["cpu"]
        row["sub_total_cpu"] += r["cpu"]
  seen: set[str] = set()
  for _, key, _, file, secs in sorted(keyed):
    if key in seen:
      rows[file]["again"] += 1
      rows[file]["again_s"] += secs
    seen.add(key)
  return {file: dict(values) for file, values in rows.items()}


COLUMNS = ("tests", "wall", "cpu", "sub_cpu", "compile", "trace", "programs", "hits", "again", "again_s", "procs",
           "startup", "startup_cpu")


def _options(argv: list[str]) -> dict[str, str] | None:
  flags = argv[2::2]
  if len(argv) < 2 or len(argv) % 2 != 0 or any(flag not in ("--json", "--costs", "--measured") for flag in flags):
    return None
  if "--measured" in flags and "--costs" not in flags:
    return None
  return dict(zip(argv[2::2], argv[3::2]))


def main(argv: list[str]) -> int:
  options = _options(argv)
  if options is None:
    print(__doc__.splitlines()[2], file=sys.stderr)
    return 2
  table = summarise(argv[1])
  ordered = sorted(table.items(), key=lambda kv: -kv[1].get("wall", 0.0))
  print(f"{'file':48s}" + "".join(f"{c:>9s}" for c in COLUMNS))
  totals = collections.defaultdict(float)
  for file, row in ordered:
    print(f"{file[-48:]:48s}" + "".join(f"{row.get(c, 0.0):9.0f}" for c in COLUMNS))
    for c in COLUMNS:
      totals[c] += row.get(c, 0.0)
  print(f"{'total':48s}" + "".join(f"{totals[c]:9.0f}" for c in COLUMNS))
  if "--json" in options:
    with open(options["--json"], "w", encoding="utf-8") as f:
      json.dump(table, f, indent=1, sort_keys=True)
  if "--costs" in options:
    costs = {file: round(row.get("cpu", 0.0) + row.get("sub_cpu", 0.0), 1) for file, row in table.items()
             if file.startswith("tests/")}
    with open(options["--costs"], "w", encoding="utf-8") as f:
      measured = options.get("--measured", "a whole-suite profile (DLM_JAX_SUITE_PROFILE), tests/profiling/report.py")
      json.dump({"measured": measured, "cpu_seconds": costs}, f, indent=1, sort_keys=True)
      f.write("\n")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
