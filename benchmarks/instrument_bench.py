r"""Activation-hook benchmark: what captures and patches cost in the compiled LLaDA sampler (issue 24 item 7).

On one random model (float32, LLaDA low-confidence decoding, temperature 0) it measures and prints:

1. No hooks, program unchanged: the optimized HLO of the sampler program (`jax.jit` of `llada.generate`,
   no `hooks` given) compiled from this tree and from the tree at `--baseline_commit` (the commit before
   the hooks landed, extracted with `git archive` into a temporary directory), each in its own
   interpreter, compared as text without source locations (`normalized_hlo`). Both
   programs are also timed, each in a persistent worker process, interleaved with the variants below.
2. Capture cost: the same run with `Capture("hook_resid_post", reduce="mean", positions=...)` at every
   layer and step, for positions "masked" and "decoded": ms per step and the ratio to the run without hooks.
3. Patching cost: a clean run capturing `hook_resid_pre` at one layer at every step, then the corrupted
   prompt decoded with `Edit("hook_resid_pre", "replace", source="values")` at that layer and every step
   (values from the clean run, `dlm_jax.analysis.patching.patch_values`): ms per step of the patched run,
   of the run without hooks and of one plain forward call (`model.forward` jitted on the canvas, logits of
   one block, as a sampler step computes them); the extra time per patched step in forwards.
4. Capture bytes: `dlm_jax.sampling.driver.capture_bytes` against the bytes of the arrays the run
   returns in `Trace.captures`, for three plans: hook_resid_post at every layer and step unreduced; its
   mean over the masked positions; the logit lens at the masked positions every 8th step.

Timing: every program is compiled and run once first; then `--rounds` rounds run each once in turn
(the baseline and current no-hook programs in their workers, the others in this process), so load from
other processes falls on all alike. Two clocks: wall time, and the CPU time of the process that ran the
program (all its threads; on a loaded machine waiting for a core does not count, so it is the steadier
one). Per variant and clock: the median ms per step over rounds, and the min and max (the spread); ratios
are medians of the per-round ratios (each round's runs are neighbours in time).
The CPU model (/proc/cpuinfo) and the load average before and after are printed and written to the JSON.

    python -m benchmarks.instrument_bench                   # width 512, 8 layers, canvas 256, 32 steps
    python -m benchmarks.instrument_bench --quick           # tiny shapes, one round (smoke test)
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app, flags
from dlm_jax.sampling.run_setup import RunSetup

_QUICK = flags.DEFINE_bool("quick", False, "Tiny shapes and one round (a smoke test; the figures mean nothing).")
_WIDTH = flags.DEFINE_integer("width", 512, "Model width D.")
_LAYERS = flags.DEFINE_integer("layers", 8, "Layers L.")
_HEADS = flags.DEFINE_integer("heads", 8, "Attention heads N (MHA, head dim D / N).")
_VOCAB = flags.DEFINE_integer("vocab_size", 16384, "Vocabulary V.")
_PROMPT = flags.DEFINE_integer("prompt_length", 128, "Prompt tokens.")
_GEN = flags.DEFINE_integer("gen_length", 128, "Generated tokens.")
_BLOCK = flags.DEFINE_integer("block_length", 32, "Semi-autoregressive block length.")
_STEPS = flags.DEFINE_integer("steps", 32, "Denoising steps.")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "Interleaved timing rounds (the median counts).")
_PATCH_LAYER = flags.DEFINE_integer("patch_layer", None, "The layer patched (default: L // 2).")
_BASELINE = flags.DEFINE_string("baseline_commit", "74e8e87", "The commit before the hooks landed (empty: skip "
                                "the comparison with it).")
_JSON_OUT = flags.DEFINE_string("json_out", "instrument_bench.json", "Where to write all results.")
_WORKER = flags.DEFINE_string("worker", None, "Internal: serve the no-hook sampler of this JSON spec on stdin.")

_QUICK_SHAPE = dict(width=32, layers=2, heads=2, vocab=64, prompt=8, gen=8, block=4, steps=4, rounds=1)
_METADATA = re.compile(r",? metadata=\{[^{}]*\}")
_DEBUG_TABLES = re.compile(r"^(FileNames|FunctionNames|FileLocations|StackFrames)\n(.+\n)*\n?", re.MULTILINE)


def normalized_hlo(text: str) -> str:
  """Optimized HLO text without source locations: the `metadata={...}` of every instruction (op names,
  source files and lines) and the module's FileNames / FunctionNames / FileLocations / StackFrames tables."""
  return _DEBUG_TABLES.sub("", _METADATA.sub("", text))


def _spec() -> dict:
  """The benchmark shape from the flags (or the quick shape)."""
  if _QUICK.value:
    spec = dict(_QUICK_SHAPE)
  else:
    spec = dict(width=_WIDTH.value, layers=_LAYERS.value, heads=_HEADS.value, vocab=_VOCAB.value,
                prompt=_PROMPT.value, gen=_GEN.value, block=_BLOCK.value, steps=_STEPS.value, rounds=_ROUNDS.value)
  spec["patch_layer"] = spec["layers"] // 2 if _PATCH_LAYER.value is None else _PATCH_LAYER.value
  return spec


def _model(spec: dict):
  """(config, random params, prompt [1, Lp], LLaDA options) of the benchmark shape; only names that
  predate the hooks, so the baseline tree builds the same inputs."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from dlm_jax import model  # pylint: disable=import-outside-toplevel
  from dlm_jax.config import ModelConfig  # pylint: disable=import-outside-toplevel
  from dlm_jax.sampling.llada import LLaDAOptions  # pylint: disable=import-outside-toplevel
  width, heads, vocab = spec["width"], spec["heads"], spec["vocab"]
  config = ModelConfig(name=f"ibench-{width}", d_model=width, n_layers=spec["layers"], n_heads=heads,
                       n_kv_heads=heads, head_dim=width // heads, mlp_hidden=3 * width, vocab_size=vocab,
                       rope_theta=500000.0, rope_fp32=True, mask_token_id=vocab - 1, eos_token_id=1,
                       eot_token_id=2, bos_token_id=0, pad_token_id=1)
  params = model.init_params(config, jax.random.key(0))
  prompt = np.random.default_rng(1).integers(3, vocab - 1, size=(1, spec["prompt"])).astype(np.int32)
  options = LLaDAOptions(gen_length=spec["gen"], steps=spec["steps"], block_length=spec["block"])
  return config, params, prompt, options


def _plain_sampler(config, options):
  """The sampler program without hooks: `llada.generate` jitted as the benchmarks time it."""
  import jax  # pylint: disable=import-outside-toplevel
  from dlm_jax.sampling.llada import generate  # pylint: disable=import-outside-toplevel
  return jax.jit(lambda params, prompt: generate(params, prompt, config=config, options=options))


def _serve(spec: dict) -> None:
  """Worker: compiles the no-hook sampler from the `dlm_jax` on sys.path, writes its optimized HLO
  (`normalized_hlo`) to spec["hlo_out"], prints a ready line, then runs the program once per stdin line
  and prints its wall and CPU seconds (`_clocks`)."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import dlm_jax  # pylint: disable=import-outside-toplevel
  config, params, prompt, options = _model(spec)
  compiled = _plain_sampler(config, options).lower(params, prompt).compile()
  text = normalized_hlo(compiled.as_text())
  with open(spec["hlo_out"], "w") as f:
    f.write(text)
  tokens = np.asarray(jax.block_until_ready(compiled(params, prompt)).tokens)
  print(json.dumps({"ready": True, "dlm_jax": os.path.dirname(dlm_jax.__file__), "tokens": tokens.tolist()}),
        flush=True)
  for _ in sys.stdin:
    print(json.dumps({"clocks": _clocks(lambda: jax.block_until_ready(compiled(params, prompt)))}), flush=True)


class _Worker:
  """A `_serve` process on the `dlm_jax` of `tree` (cwd and PYTHONPATH: the tree; this file run by path),
  with JAX's persistent compilation cache off: a cache shared by the two workers (the test suite sets one)
  could hand the baseline worker the current tree's executable, and the comparison would compare one
  program with itself."""

  def __init__(self, tree: str, spec: dict):
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env.update(PYTHONPATH=tree, JAX_ENABLE_COMPILATION_CACHE="false")
    self.process = subprocess.Popen([sys.executable, os.path.abspath(__file__), f"--worker={json.dumps(spec)}"],
                                    cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    self.ready = self._reply()
    if os.path.realpath(self.ready["dlm_jax"]) != os.path.realpath(os.path.join(tree, "dlm_jax")):
      raise RuntimeError(f"worker for {tree} imported dlm_jax from {self.ready['dlm_jax']}")

  def _reply(self) -> dict:
    line = self.process.stdout.readline()
    if not line:
      raise RuntimeError(f"worker {self.process.args} exited with {self.process.wait()}")
    return json.loads(line)

  def run(self) -> tuple[float, float]:
    """(wall, CPU) seconds of one run of the worker's program."""
    self.process.stdin.write("run\n")
    self.process.stdin.flush()
    return tuple(self._reply()["clocks"])

  def close(self) -> None:
    self.process.stdin.close()
    self.process.wait()


@contextlib.contextmanager
def _baseline_tree(commit: str):
  """A temporary directory holding `dlm_jax` as of `commit` (git archive of this repository)."""
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  with tempfile.TemporaryDirectory(prefix="instrument_bench_") as tree:
    archive = subprocess.run(["git", "-C", repo, "archive", commit, "dlm_jax"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", tree], input=archive.stdout, check=True)
    yield tree


def _hlo_comparison(current: str, baseline: str) -> dict:
  """The two HLO texts compared: identical or not, sizes, digests and the first differing lines."""
  a, b = open(current).read().splitlines(), open(baseline).read().splitlines()
  diff = [(i, x, y) for i, (x, y) in enumerate(zip(a, b)) if x != y]
  return {"identical": a == b, "lines": [len(a), len(b)],
          "sha256": [hashlib.sha256("\n".join(t).encode()).hexdigest()[:16] for t in (a, b)],
          "differing_lines": len(diff) + abs(len(a) - len(b)), "first_differences": diff[:3]}


def _hooked_variants(spec: dict, config, params, prompt, options):
  """The in-process timed programs: {name: (jitted run(params, prompt) -> Trace, its extra arguments)},
  and the patched run's inputs. Builds the clean capture and the patch values by running the clean run."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from dlm_jax.analysis.patching import patch_values  # pylint: disable=import-outside-toplevel
  from dlm_jax.instrument.hook_call import hook_values  # pylint: disable=import-outside-toplevel
  from dlm_jax.instrument.hook_spec import Capture, Edit, Hooks  # pylint: disable=import-outside-toplevel
  from dlm_jax.sampling.llada import generate  # pylint: disable=import-outside-toplevel
  layer = spec["patch_layer"]
  seq = spec["prompt"] + spec["gen"]

  def sampler(hooks):
    return jax.jit(lambda params, prompt, values: generate(params, prompt, config=config, options=options,
                                                           setup=RunSetup(hooks=hooks, hook_values=values)))

  masked = Hooks(captures=(Capture("hook_resid_post", reduce="mean", positions="masked"),))
  decoded = Hooks(captures=(Capture("hook_resid_post", reduce="mean", positions="decoded"),))
  clean = Hooks(captures=(Capture("hook_resid_pre", layers=(layer,)),))
  patched = Hooks(edits=(Edit("hook_resid_pre", "replace", layers=(layer,), source="values"),))
  corrupted = prompt.copy()
  corrupted[0, -1] = 3 + (int(prompt[0, -1]) - 2) % (spec["vocab"] - 4)
  clean_run = sampler(clean)
  clean_trace = clean_run(params, prompt, hook_values(clean, config, 1, seq))
  values, value_steps = patch_values(clean_trace, [f"blocks.{layer}.hook_resid_pre"])
  patch = hook_values(patched, config, 1, seq, edits={0: dict(values=values, value_steps=value_steps)})
  runs = {"capture mean masked": (sampler(masked), prompt, hook_values(masked, config, 1, seq)),
          "capture mean decoded": (sampler(decoded), prompt, hook_values(decoded, config, 1, seq)),
          "clean capture (1 layer)": (clean_run, prompt, hook_values(clean, config, 1, seq)),
          "patched (1 layer)": (sampler(patched), corrupted, patch)}
  facts = {"patch_values_shape": list(values.shape), "patched_steps": int(np.sum(np.asarray(value_steps) >= 0)),
           "corrupted_prompt_differs_at": spec["prompt"] - 1}
  return runs, facts


def _forward_loop(spec: dict, config, params, prompt):
  """run() timing `steps` plain forward calls on a canvas (prompt + masks), logits of the first generated
  block (a sampler step computes one block's logits)."""
  import functools  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from dlm_jax import model  # pylint: disable=import-outside-toplevel
  canvas = np.concatenate([prompt, np.full((1, spec["gen"]), config.mask_token_id, np.int32)], axis=1)
  window = (spec["prompt"], spec["prompt"] + spec["block"])
  call = jax.jit(functools.partial(model.forward, config=config, readout=model.Readout(window=window)))
  jax.block_until_ready(call(params, canvas).logits)

  def run():
    out = None
    for _ in range(spec["steps"]):
      out = call(params, canvas)
    jax.block_until_ready(out.logits)

  return run


def _capture_plans(spec: dict, config, params, prompt, options) -> list[dict]:
  """Item 4: for each plan, capture_bytes (abstract evaluation) and the bytes of the returned captures."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from dlm_jax.instrument.hook_call import CaptureValues, hook_values  # pylint: disable=import-outside-toplevel
  from dlm_jax.instrument.hook_spec import Capture, Hooks, Steps  # pylint: disable=import-outside-toplevel
  from dlm_jax.sampling.driver import capture_bytes  # pylint: disable=import-outside-toplevel
  from dlm_jax.sampling.llada import generate  # pylint: disable=import-outside-toplevel
  seq = spec["prompt"] + spec["gen"]
  targets = np.random.default_rng(3).integers(3, spec["vocab"] - 1, size=(1, seq)).astype(np.int32)
  plans = [("full hook_resid_post, every layer and step", Hooks(captures=(Capture("hook_resid_post"),)), {}),
           ("mean hook_resid_post over masked positions, every layer and step",
            Hooks(captures=(Capture("hook_resid_post", reduce="mean", positions="masked"),)), {}),
           ("logit lens k=5 at masked positions, every layer, every 8th step",
            Hooks(captures=(Capture("hook_resid_post", reduce="lens", k=5, positions="masked", steps=Steps.every(8)),)),
            {0: CaptureValues(targets=targets)})]
  out = []
  for what, hooks, capture_values in plans:
    values = hook_values(hooks, config, 1, seq, captures=capture_values)

    def run(hooks=hooks, values=values):
      return generate(params, prompt, config=config, options=options, setup=RunSetup(hooks=hooks, hook_values=values))

    planned = capture_bytes(run)
    trace = jax.block_until_ready(run())
    returned = sum(np.asarray(leaf).nbytes for leaf in jax.tree.leaves(trace.captures))
    steps_bytes = sum(np.asarray(leaf).nbytes for leaf in jax.tree.leaves(trace.capture_steps))
    out.append({"plan": what, "capture_bytes": planned, "returned_bytes": returned, "equal": planned == returned,
                "capture_steps_bytes": steps_bytes, "arrays": len(jax.tree.leaves(trace.captures))})
    del trace
  return out


def _clocks(run) -> tuple[float, float]:
  """(wall seconds, CPU seconds of this process, all threads) of run()."""
  wall, cpu = time.perf_counter(), time.process_time()
  run()
  return time.perf_counter() - wall, time.process_time() - cpu


def _median_ratio(numerator: list[float], denominator: list[float]) -> float:
  return statistics.median(n / d for n, d in zip(numerator, denominator))


def _ratios(per_step: dict[str, list[float]]) -> dict[str, float]:
  """The figures' ratios from ms per step per round, each the median over rounds of the round's ratio."""
  base = per_step["no hooks"]
  ratios = {}
  if "baseline (no hooks, worker)" in per_step:
    ratios["current / baseline (workers)"] = _median_ratio(per_step["current (no hooks, worker)"],
                                                           per_step["baseline (no hooks, worker)"])
  for name in ("capture mean masked", "capture mean decoded", "clean capture (1 layer)", "patched (1 layer)"):
    ratios[f"{name} / no hooks"] = _median_ratio(per_step[name], base)
  extra = [p - b for p, b in zip(per_step["patched (1 layer)"], base)]
  ratios["(patched - no hooks) / plain forward"] = _median_ratio(extra, per_step["plain forward call"])
  ratios["plain forward / no-hook step"] = _median_ratio(per_step["plain forward call"], base)
  return ratios


def _print_clock(clock: str, results: dict, spec: dict) -> None:
  """The table, ratios and figures 2 and 3 of one clock (wall or CPU time)."""
  print(f"\n{clock} time: {'program':<30} {'ms/step median':>14} {'min':>8} {'max':>8}  same tokens as no hooks")
  for name, row in results[f"{clock}_ms_per_step"].items():
    same = results["same_tokens_as_no_hooks"].get(name, "")
    print(f"{clock} time: {name:<30} {row['median']:>14.2f} {row['min']:>8.2f} {row['max']:>8.2f}  {same}")
  ratios = results[f"{clock}_ratios"]
  print(f"{clock} time ratios (median over rounds of each round's ratio):")
  for name, value in ratios.items():
    print(f"  {name:<42} {value:.3f}")
  print(f"2. ({clock} time) capture mean per class, every layer and step: masked "
        f"{100 * (ratios['capture mean masked / no hooks'] - 1):+.1f}%, decoded "
        f"{100 * (ratios['capture mean decoded / no hooks'] - 1):+.1f}% of the step time (target <= +10%)")
  print(f"3. ({clock} time) patching one site at one layer, {results['patching']['patched_steps']} patched steps: "
        f"{ratios['(patched - no hooks) / plain forward']:+.3f} forwards extra per step (target <= 1)", flush=True)


def _write_json(path: str, results: dict) -> None:
  tmp = f"{path}.tmp"
  with open(tmp, "w") as f:
    json.dump(results, f, indent=2)
  os.replace(tmp, path)


def _measure(spec: dict, baseline_tree: str | None, hlo_dir: str) -> dict:
  """Items 1–4 on `spec`; prints each figure as it is measured."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  results: dict = {}
  workers = {"current (no hooks, worker)": _Worker(repo, {**spec, "hlo_out": os.path.join(hlo_dir, "current.hlo")})}
  if baseline_tree is not None:
    workers["baseline (no hooks, worker)"] = _Worker(baseline_tree, {**spec, "hlo_out": os.path.join(hlo_dir,
                                                                                                   "baseline.hlo")})
    hlo = _hlo_comparison(os.path.join(hlo_dir, "current.hlo"), os.path.join(hlo_dir, "baseline.hlo"))
    hlo["same_tokens"] = workers["current (no hooks, worker)"].ready["tokens"] == \
        workers["baseline (no hooks, worker)"].ready["tokens"]
    results["hlo"] = hlo
    print(f"1. optimized HLO of the no-hook sampler, source locations removed: {'IDENTICAL' if hlo['identical'] else 'DIFFERENT'}"
          f" ({hlo['lines'][0]} vs {hlo['lines'][1]} lines, sha256 {hlo['sha256'][0]} vs {hlo['sha256'][1]}, "
          f"{hlo['differing_lines']} differing lines); same tokens: {hlo['same_tokens']}", flush=True)
    for i, x, y in hlo["first_differences"]:
      print(f"   line {i}: current  {x[:160]}\n   line {i}: baseline {y[:160]}")
  config, params, prompt, options = _model(spec)
  plain = _plain_sampler(config, options)
  runs = {"no hooks": (lambda: plain(params, prompt))}
  hooked, results["patching"] = _hooked_variants(spec, config, params, prompt, options)
  for name, (run, tokens, values) in hooked.items():
    runs[name] = lambda run=run, tokens=tokens, values=values: run(params, tokens, values)
  first = {name: np.asarray(jax.block_until_ready(run()).tokens) for name, run in runs.items()}
  results["same_tokens_as_no_hooks"] = {name: bool(np.array_equal(first[name], first["no hooks"])) for name in first}
  forward = _forward_loop(spec, config, params, prompt)
  timed = {**{name: w.run for name, w in workers.items()},
           **{name: (lambda run=run: jax.block_until_ready(run())) for name, run in runs.items()},
           "plain forward call": forward}
  times = {name: [] for name in timed}
  for _ in range(spec["rounds"]):
    for name, run in timed.items():
      times[name].append(run() if name in workers else _clocks(run))
  for worker in workers.values():
    worker.close()
  for clock, index in (("wall", 0), ("cpu", 1)):
    per_step = {name: [1e3 * t[index] / spec["steps"] for t in ts] for name, ts in times.items()}
    results[f"{clock}_ms_per_step"] = {name: {"median": statistics.median(ms), "min": min(ms), "max": max(ms),
                                              "rounds": ms} for name, ms in per_step.items()}
    results[f"{clock}_ratios"] = _ratios(per_step)
    _print_clock(clock, results, spec)
  results["capture_plans"] = _capture_plans(spec, config, params, prompt, options)
  print("4. capture bytes: capture_bytes (planned) vs the arrays Trace.captures returned")
  for plan in results["capture_plans"]:
    print(f"   {plan['plan']}: planned {plan['capture_bytes']} B, returned {plan['returned_bytes']} B "
          f"in {plan['arrays']} arrays, equal: {plan['equal']} (capture_steps {plan['capture_steps_bytes']} B)")
  return results


def main(argv):
  del argv
  if _WORKER.value:
    _serve(json.loads(_WORKER.value))
    return
  from dlm_jax.runtime import xla_cpu  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  import jaxlib  # pylint: disable=import-outside-toplevel
  spec = _spec()
  cpu = xla_cpu.cpu_info()
  load = os.getloadavg()
  print(f"CPU: {cpu.model} ({cpu.vendor}), {os.cpu_count()} logical CPUs; jax {jax.__version__}, jaxlib "
        f"{jaxlib.__version__}; load average {' '.join(f'{x:.2f}' for x in load)}")
  print(f"shape: width {spec['width']}, {spec['layers']} layers, {spec['heads']} heads, MLP {3 * spec['width']}, "
        f"vocab {spec['vocab']}, batch 1, prompt {spec['prompt']} + {spec['gen']} generated (canvas "
        f"{spec['prompt'] + spec['gen']}), blocks of {spec['block']}, {spec['steps']} steps, float32, LLaDA "
        f"low-confidence; patched layer {spec['patch_layer']}; {spec['rounds']} rounds", flush=True)
  results = {"cpu": dataclasses.asdict(cpu), "jax_version": jax.__version__, "jaxlib_version": jaxlib.__version__,
             "load_average_before": load, "spec": spec, "baseline_commit": _BASELINE.value}
  with tempfile.TemporaryDirectory(prefix="instrument_bench_hlo_") as hlo_dir:
    if _BASELINE.value:
      with _baseline_tree(_BASELINE.value) as tree:
        results.update(_measure(spec, tree, hlo_dir))
    else:
      results.update(_measure(spec, None, hlo_dir))
  results["load_average_after"] = os.getloadavg()
  print(f"load average after: {' '.join(f'{x:.2f}' for x in results['load_average_after'])}")
  _write_json(_JSON_OUT.value, results)
  print(f"results written to {_JSON_OUT.value}")


if __name__ == "__main__":
  app.run(main)
