"""The activation-hook benchmark runs end to end in its quick mode and prints its figures (no timing assertions:
the speed goals are read from the benchmark's printed figures, BUILD.md). The comparison of the no-hook
program with the commit before the hooks (figure 1) needs that commit's tree and is a one-time measurement
recorded in BUILD.md, so the smoke test skips it (`--baseline_commit=`) and tests the HLO clean-up alone."""

import json
import os
import subprocess
import sys

from benchmarks.instrument_bench import normalized_hlo


def test_quick_mode_prints_every_figure_and_writes_json(tmp_path):
  out = tmp_path / "ibench.json"
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  done = subprocess.run([sys.executable, "-m", "benchmarks.instrument_bench", "--quick", "--baseline_commit=",
                         f"--json_out={out}"],
                        capture_output=True, text=True, check=False, timeout=900, env=env)
  assert done.returncode == 0, done.stderr[-3000:]
  results = json.loads(out.read_text())
  assert f"CPU: {results['cpu']['model']}" in done.stdout
  figures = ["4. capture bytes"] + [
      f"{n}. ({clock} time) {what}" for clock in ("wall", "cpu")
      for n, what in ((2, "capture mean per class"), (3, "patching one site"))]
  assert all(figure in done.stdout for figure in figures)
  assert "hlo" not in results
  assert set(results["wall_ms_per_step"]) == set(results["cpu_ms_per_step"]) == {
      "current (no hooks, worker)", "no hooks", "capture mean masked",
      "capture mean decoded", "clean capture (1 layer)", "patched (1 layer)", "plain forward call"}
  assert all(row["median"] > 0 for row in results["wall_ms_per_step"].values())
  assert all(same for name, same in results["same_tokens_as_no_hooks"].items() if name != "patched (1 layer)")
  assert "(patched - no hooks) / plain forward" in results["cpu_ratios"]
  assert len(results["capture_plans"]) == 3 and all(plan["equal"] for plan in results["capture_plans"])


def test_normalized_hlo_drops_source_locations_only():
  text = ("HloModule m, is_scheduled=true\n\nFileNames\n1 \"/a/x.py\"\n\nFunctionNames\n1 \"f\"\n\n"
          "FileLocations\n1 {file_name_id=1 function_name_id=1 line=3}\n\nStackFrames\n1 {file_location_id=1}\n\n"
          "ENTRY %main (p: f32[2]) -> f32[2] {\n  %p = f32[2]{0} parameter(0), metadata={op_name=\"jit(f)\" "
          "source_file=\"/a/x.py\" source_line=3}\n  ROOT %n = f32[2]{0} negate(%p)\n}\n")
  assert normalized_hlo(text) == ("HloModule m, is_scheduled=true\n\nENTRY %main (p: f32[2]) -> f32[2] {\n"
                                  "  %p = f32[2]{0} parameter(0)\n  ROOT %n = f32[2]{0} negate(%p)\n}\n")
