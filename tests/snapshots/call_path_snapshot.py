"""Bitwise before/after snapshots of the model call path (issue 35 item 6).

    python tests/snapshots/call_path_snapshot.py --write DIR      # on the tree before a change
    python tests/snapshots/call_path_snapshot.py --compare DIR    # on the tree after it

--write runs the fixed matrix of `call_path_cases.CASES` (every sampler family and decoding mode, statistics,
top sinks, interventions, captures and edits, the plain forward calls) through the public entry points of
`call_path_entries` and writes every array each case returns into DIR/<case>.npz, and DIR/index.json
(per case: its setup row, and per array its shape, dtype and the SHA-256 of its bytes; the environment).
DIR must not exist or be empty: a snapshot is never overwritten.

--compare reruns the matrix and reports per case and array: bitwise equal, or the number of differing
elements, the first differing index with both values and the largest absolute difference; a case that
raises is reported with its one-line error. Exit status 1 on any difference, error, missing case or array,
or a case whose setup row changed since the snapshot. The random weights of the preset models are read
from the snapshot (its init_* cases, which are compared too), so a change of `init_params` shows in those
cases alone.

--cases REGEX runs only the matching cases (the others are then not reported missing). Everything runs in
float32 with the highest matmul precision and fixed PRNG keys, on the CPU unless JAX_PLATFORMS says
otherwise; bitwise equality holds between runs of the same JAX, XLA flags and CPU, which the index records
and --compare sets side by side. The script imports the dlm_jax of the tree it lives in. It is not a test
file: pytest does not collect it (BUILD.md, "Bitwise before/after snapshots").
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import multiprocessing
import os
import platform
import re
import subprocess
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(_HERE))
for _path in (_ROOT, _HERE):  # this tree's dlm_jax before any installed one, and the case table
  if _path in sys.path:
    sys.path.remove(_path)
  sys.path.insert(0, _path)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (the platform must be chosen before JAX starts)
import numpy as np  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_enable_x64", False)

import call_path_entries as entries  # noqa: E402
from call_path_cases import CASES, Case  # noqa: E402

INDEX = "index.json"
FORMAT = 1


class UserError(Exception):
  """A bad command line or snapshot directory: one line, exit 1."""


# ------------------------------------------------------------------------------------------ files


def sha256(array: np.ndarray) -> str:
  return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def _atomic(path: str, write) -> None:
  tmp = os.path.join(os.path.dirname(path), f".tmp-{os.getpid()}-{os.path.basename(path)}")
  with open(tmp, "wb") as f:
    write(f)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def save_case(directory: str, name: str, arrays: dict[str, np.ndarray]) -> None:
  _atomic(os.path.join(directory, f"{name}.npz"), lambda f: np.savez(f, **arrays))


def load_case(directory: str, name: str) -> dict[str, np.ndarray]:
  with np.load(os.path.join(directory, f"{name}.npz")) as data:
    return {k: data[k] for k in data.files}


def setup_row(case: Case) -> dict:
  """The case's row as JSON data (as recorded in the index)."""
  return json.loads(json.dumps(dataclasses.asdict(case)))


def environment() -> dict[str, str]:
  """What bitwise equality depends on besides the tree, and the tree's commit."""
  import dlm_jax  # pylint: disable=import-outside-toplevel
  import jaxlib  # pylint: disable=import-outside-toplevel
  cpu = ""
  if os.path.exists("/proc/cpuinfo"):
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
  try:
    head = subprocess.run(["git", "-C", _ROOT, "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", _ROOT, "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, check=True).stdout.strip()
    commit = head + (" (uncommitted changes)" if dirty else "")
  except (OSError, subprocess.CalledProcessError):
    commit = "unknown"
  return {"commit": commit, "dlm_jax": os.path.dirname(os.path.abspath(dlm_jax.__file__)),
          "jax": jax.__version__, "jaxlib": jaxlib.__version__, "numpy": np.__version__,
          "python": platform.python_version(), "backend": jax.default_backend(),
          "devices": str(jax.devices()[0].device_kind), "cpu": cpu, "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")}


# ------------------------------------------------------------------------------------------ running


def _error_line(error: BaseException) -> str:
  text = str(error).strip().splitlines()
  return f"{type(error).__name__}: {text[0] if text else ''}"


def run_case(case: Case, frozen: dict[str, dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
  """The case's arrays; an init case also freezes its preset's weights for the cases after it (unless the
  snapshot already gave them)."""
  if case.entry == "init":
    arrays = entries.random_params(case.model)
    frozen.setdefault(case.model, arrays)
    return arrays
  config, params = entries.load_model(case.model, frozen)
  return entries.run(case, config, params)


_FROZEN: dict[str, dict[str, np.ndarray]] = {}
"""The random weights of the preset models, by preset (a worker process's copy)."""

_BY_NAME = {case.name: case for case in CASES}


def _set_frozen(frozen: dict[str, dict[str, np.ndarray]]) -> None:
  global _FROZEN  # pylint: disable=global-statement
  _FROZEN = frozen


def _timed(name: str) -> tuple[str, dict[str, np.ndarray] | None, str | None, float, float]:
  """(name, arrays or None, the one-line error or None, wall seconds, CPU seconds) of one case."""
  start, cpu = time.perf_counter(), time.process_time()
  try:
    arrays, error = run_case(_BY_NAME[name], _FROZEN), None
  except Exception as exception:  # pylint: disable=broad-except
    arrays, error = None, _error_line(exception)
  return name, arrays, error, time.perf_counter() - start, time.process_time() - cpu


def results(cases: list[Case], frozen: dict[str, dict[str, np.ndarray]], jobs: int):
  """`_timed` of every case, in table order: the init cases here first (their weights go to the others),
  then the rest here (jobs 1) or in `jobs` spawned worker processes."""
  _set_frozen(frozen)
  rest = [case.name for case in cases if case.entry != "init"]
  for case in cases:
    if case.entry == "init":
      yield _timed(case.name)
  if jobs <= 1 or len(rest) < 2:
    yield from map(_timed, rest)
    return
  with multiprocessing.get_context("spawn").Pool(jobs, initializer=_set_frozen, initargs=(frozen,)) as pool:
    yield from pool.imap(_timed, rest)


def selected(pattern: str | None) -> list[Case]:
  if pattern is None:
    return list(CASES)
  try:
    regex = re.compile(pattern)
  except re.error as error:
    raise UserError(f"--cases={pattern}: not a regular expression ({error})") from None
  cases = [c for c in CASES if regex.search(c.name)]
  if not cases:
    raise UserError(f"--cases={pattern}: matches none of the {len(CASES)} cases (--list shows them)")
  return cases


# ------------------------------------------------------------------------------------------ comparing


def _bits(array: np.ndarray) -> np.ndarray:
  """The array's elements as unsigned integers of their width (bitwise comparison: −0 ≠ 0, NaN = same NaN)."""
  flat = np.ascontiguousarray(array).reshape(-1)
  if flat.dtype.itemsize not in (1, 2, 4, 8):
    return flat
  return flat.view(f"u{flat.dtype.itemsize}")


def difference(expected: np.ndarray, actual: np.ndarray) -> str | None:
  """None when bitwise equal, else one line: how many elements differ, the first (index, snapshot -> now)
  and the largest absolute difference."""
  if expected.shape != actual.shape or expected.dtype != actual.dtype:
    return (f"shape/dtype {list(expected.shape)} {expected.dtype} in the snapshot, {list(actual.shape)} "
            f"{actual.dtype} now")
  differs = _bits(expected) != _bits(actual)
  if not differs.any():
    return None
  first = int(np.flatnonzero(differs)[0])
  index = tuple(int(i) for i in np.unravel_index(first, expected.shape)) if expected.ndim else ()
  before, after = expected.reshape(-1)[first], actual.reshape(-1)[first]
  line = f"{int(differs.sum())} of {differs.size} elements differ; first at {index}: {before!r} -> {after!r}"
  if expected.dtype.kind in "biuf":
    gap = np.abs(expected.reshape(-1)[differs].astype(np.float64) - actual.reshape(-1)[differs].astype(np.float64))
    line += f"; max |diff| {np.nanmax(gap) if not np.isnan(gap).all() else float('nan'):.6g}"
  return line


def _describe(array: np.ndarray) -> str:
  return f"{list(array.shape)} {array.dtype}"


def compare_case(directory: str, recorded: dict, arrays: dict[str, np.ndarray], show_equal: bool) -> list[str]:
  """The report lines of one case's arrays against the snapshot (an empty list: bitwise equal, when
  `show_equal` is off)."""
  lines, snapshot = [], None
  for name in sorted(set(recorded["arrays"]) | set(arrays)):
    if name not in arrays:
      lines.append(f"  missing  {name}: in the snapshot ({recorded['arrays'][name]['shape']}), not returned now")
      continue
    if name not in recorded["arrays"]:
      lines.append(f"  extra    {name} {_describe(arrays[name])}: returned now, not in the snapshot")
      continue
    entry, array = recorded["arrays"][name], arrays[name]
    if (entry["sha256"] == sha256(array) and entry["shape"] == list(array.shape)
        and entry["dtype"] == str(array.dtype)):
      if show_equal:
        lines.append(f"  equal    {name} {_describe(array)}")
      continue
    if snapshot is None:
      snapshot = load_case(directory, recorded["name"])
    lines.append(f"  DIFFERS  {name} {_describe(array)}: {difference(snapshot[name], array)}")
  return lines


# ------------------------------------------------------------------------------------------ commands


def write(directory: str, cases: list[Case], jobs: int) -> int:
  if os.path.exists(directory) and (not os.path.isdir(directory) or os.listdir(directory)):
    raise UserError(f"--write={directory}: exists and is not an empty directory; a snapshot is never "
                    "overwritten (choose a new directory)")
  os.makedirs(directory, exist_ok=True)
  index = {"format": FORMAT, "environment": environment(), "cases": {}}
  print(f"writing {len(cases)} cases of {index['environment']['dlm_jax']} at {index['environment']['commit']}")
  failed, cpu_total = 0, 0.0
  for number, (name, arrays, error, wall, cpu) in enumerate(results(cases, {}, jobs), 1):
    entry = {"name": name, "setup": setup_row(_BY_NAME[name]), "arrays": {}, "error": error,
             "seconds": round(wall, 2), "cpu_seconds": round(cpu, 2)}
    if error is None:
      save_case(directory, name, arrays)
      entry["arrays"] = {k: {"shape": list(v.shape), "dtype": str(v.dtype), "sha256": sha256(v)}
                         for k, v in sorted(arrays.items())}
      status = f"{len(arrays)} arrays"
    else:
      status, failed = f"ERROR {error}", failed + 1
    index["cases"][name] = entry
    cpu_total += cpu
    print(f"[{number:2d}/{len(cases)}] {name:32s} {status} ({wall:.1f} s, cpu {cpu:.1f} s)", flush=True)
  _atomic(os.path.join(directory, INDEX), lambda f: f.write(json.dumps(index, indent=1).encode("utf-8")))
  print(f"wrote {directory}: {len(cases) - failed} cases" + (f", {failed} raised (recorded as errors)" if failed
                                                                   else "") + f"; cpu {cpu_total:.1f} s in the cases")
  return 1 if failed else 0


def read_index(directory: str) -> dict:
  path = os.path.join(directory, INDEX)
  if not os.path.isfile(path):
    raise UserError(f"--compare={directory}: no {INDEX} there; write a snapshot with --write first")
  with open(path, encoding="utf-8") as f:
    index = json.load(f)
  if index.get("format") != FORMAT:
    raise UserError(f"--compare={directory}: {INDEX} has format {index.get('format')!r}, expected {FORMAT}")
  return index


def _refusal(case: Case, recorded: dict | None) -> str | None:
  """Why a case cannot be compared with its snapshot entry (None: it can)."""
  if recorded is None:
    return "MISSING from the snapshot (a case added since it was written)"
  if recorded["error"]:
    return f"SNAPSHOT ERROR: the snapshot recorded {recorded['error']}"
  now = setup_row(case)
  if recorded["setup"] != now:
    changed = {k: [recorded["setup"].get(k), now.get(k)] for k in sorted(set(recorded["setup"]) | set(now))
               if recorded["setup"].get(k) != now.get(k)}
    return f"SETUP CHANGED since the snapshot (field: [snapshot, now]): {json.dumps(changed)}"
  return None


def compare(directory: str, cases: list[Case], filtered: bool, show_equal: bool, jobs: int) -> int:
  index = read_index(directory)
  now = environment()
  print(f"comparing {len(cases)} cases of {now['dlm_jax']} at {now['commit']}")
  print(f"  against {directory}: {index['environment'].get('commit')}")
  for key in sorted(set(now) - {"commit", "dlm_jax"}):
    if index["environment"].get(key) != now[key]:
      print(f"  note: {key} was {index['environment'].get(key)!r}, is {now[key]!r}: bitwise equality is not "
            "expected across environments")
  frozen = {case.model: load_case(directory, case.name) for case in CASES
            if case.entry == "init" and case.name in index["cases"] and not index["cases"][case.name]["error"]}
  bad = 0
  for case in cases:
    why = _refusal(case, index["cases"].get(case.name))
    if why is not None:
      print(f"[--/{len(cases)}] {case.name:32s} {why}")
      bad += 1
  if not filtered:
    for name in sorted(set(index["cases"]) - set(_BY_NAME)):
      print(f"[--/{len(cases)}] {name:32s} MISSING from the matrix (in the snapshot, not run now)")
      bad += 1
  runnable = [case for case in cases if _refusal(case, index["cases"].get(case.name)) is None]
  for number, (name, arrays, error, wall, cpu) in enumerate(results(runnable, frozen, jobs), 1):
    head = f"[{number:2d}/{len(cases)}] {name:32s}"
    if error is not None:
      print(f"{head} ERROR {error} ({wall:.1f} s)", flush=True)
      bad += 1
      continue
    recorded = index["cases"][name]
    lines = compare_case(directory, recorded, arrays, show_equal)
    differs = [line for line in lines if not line.startswith("  equal")]
    status = (f"DIFFERS in {len(differs)} of {len(set(recorded['arrays']) | set(arrays))} arrays" if differs
              else f"bitwise equal ({len(arrays)} arrays)")
    print(f"{head} {status} ({wall:.1f} s, cpu {cpu:.1f} s)")
    for line in lines:
      print(line)
    sys.stdout.flush()
    bad += bool(differs)
  print(f"NOT EQUAL: {bad} case(s) differ, raised or are missing" if bad else f"all {len(cases)} cases bitwise equal")
  return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  mode = parser.add_mutually_exclusive_group(required=True)
  mode.add_argument("--write", metavar="DIR", help="run the matrix and write a snapshot into DIR (new or empty)")
  mode.add_argument("--compare", metavar="DIR", help="run the matrix and compare it with the snapshot in DIR")
  mode.add_argument("--list", action="store_true", help="print the case table and exit")
  parser.add_argument("--cases", metavar="REGEX", help="run only the cases whose name matches")
  parser.add_argument("--jobs", type=int, default=2,
                      help="worker processes for the cases after the init ones (default 2, the machine's cores)")
  parser.add_argument("--only_differences", action="store_true",
                      help="--compare: print no line for an array that is bitwise equal")
  args = parser.parse_args(argv)
  start = time.perf_counter()
  try:
    if args.jobs < 1:
      raise UserError(f"--jobs={args.jobs}: expected a positive number of processes")
    cases = selected(args.cases)
    if args.list:
      for case in cases:
        print(f"{case.name:32s} {json.dumps(setup_row(case))}")
      return 0
    if args.write:
      status = write(args.write, cases, args.jobs)
    else:
      status = compare(args.compare, cases, filtered=args.cases is not None, show_equal=not args.only_differences,
                       jobs=args.jobs)
  except UserError as error:
    print(f"error: {error}", file=sys.stderr)
    return 1
  print(f"wall time {time.perf_counter() - start:.1f} s")
  return status


if __name__ == "__main__":
  sys.exit(main())
