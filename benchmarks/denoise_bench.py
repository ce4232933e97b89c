r"""Denoising benchmark: dlm_jax's compiled LLaDA sampler against the PyTorch way, near the matmul peak.

For each model width and each condition — statistics off; per-head incoming attention on; top-1 sink
masking (from the previous step) on — it runs LLaDA low-confidence decoding (temperature 0) with the same
random weights and prompt in both frameworks and reports compile time, steady-state time per denoising
step, tokens/s (generated non-EOS tokens per second, as Fast-dLLM counts them), achieved FLOP/s for the
step's model FLOPs and its fraction of the machine's measured matmul peak, and the peak memory of the run.
Every measurement runs in its own subprocess; peak memory is the rise of the process's peak RSS (VmHWM,
reset after warm-up and compilation) over its RSS before the measured run. The memory sweep runs one
statistics step (per-head incoming attention) at each sequence length: dlm_jax computes the logits of
the last block only, as its sampler does; the PyTorch way runs the model with output_attentions=True
and all logits, as the official loop does.

The CPU's model name (/proc/cpuinfo), the load average and the XLA CPU options (`dlm_jax.runtime.xla_cpu`: `--xla_cpu_options`,
default auto — the set measured fastest on this CPU vendor) are printed and written to the JSON; the
parent sets XLA_FLAGS before JAX starts and every measurement subprocess runs with the same XLA_FLAGS.

The step's model FLOPs (printed with the results), for S = prompt + generated positions, window W =
the block length (only the current block can be decoded, so only its logits are needed), per layer:
  projections 2·S·D·(N·H + 2·K·H) + 2·S·N·H·D,  MLP 6·S·D·F,  attention 4·S²·N·H;
plus the LM head 2·W·D·V. The PyTorch way computes the LM head on all S positions (the official loop);
both are charged the same model FLOPs, so FLOP/s compares useful work.

    python -m benchmarks.denoise_bench                          # CPU sweep, widths 128, 256, 512
    python -m benchmarks.denoise_bench --xla_cpu_options=eigen  # the same with XLA's Eigen matmuls
    python -m benchmarks.denoise_bench --compare_xla_cpu_options=default,eigen,ynn_fused,onednn \
        --compare_query_chunks=128,256 --compare_fused_projections   # variants, interleaved (option_comparison)
    python -m benchmarks.denoise_bench --widths=4096 --layers=32 --heads=32 --prompt_length=512 \
        --gen_length=512 --block_length=32 --dtype=bfloat16 --attention_impl=fused   # LLaDA-8B shape, GPU
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time

from absl import app, flags

from benchmarks import option_comparison
from benchmarks.flops import step_flops
from dlm_jax.runtime import xla_cpu
from dlm_jax.sampling.run_setup import RunSetup

_WIDTHS = flags.DEFINE_list("widths", ["128", "256", "512"], "Model widths D to sweep.")
_LAYERS = flags.DEFINE_integer("layers", 4, "Layers L.")
_HEADS = flags.DEFINE_integer("heads", 8, "Attention heads N (MHA, head dim D / N).")
_MLP_RATIO = flags.DEFINE_float("mlp_ratio", 3.0, "MLP width F / D (LLaDA-8B: 12288 / 4096 = 3).")
_VOCAB = flags.DEFINE_integer("vocab_size", 16384, "Vocabulary V.")
_BATCH = flags.DEFINE_list("batch_sizes", ["1"], "Batch sizes to measure.")
_PROMPT = flags.DEFINE_integer("prompt_length", 64, "Prompt tokens.")
_GEN = flags.DEFINE_integer("gen_length", 128, "Generated tokens.")
_BLOCK = flags.DEFINE_integer("block_length", 32, "Semi-autoregressive block length.")
_STEPS = flags.DEFINE_integer("steps", None, "Denoising steps (default: gen_length).")
_CONDITIONS = flags.DEFINE_list("conditions", ["off", "stats", "mask1"], "Conditions: off, stats, mask1.")
_FRAMEWORKS = flags.DEFINE_list("frameworks", ["jax", "torch"], "Frameworks to run.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Weights and activations dtype.")
_IMPL = flags.DEFINE_enum("attention_impl", "chunked", ["chunked", "dense", "fused"], "dlm_jax attention path.")
_QUERY_CHUNK = flags.DEFINE_integer("query_chunk", 256, "Query block of the chunked attention (256: the default "
                                    "192 positions in one block; longer sequences in blocks of 256 queries).")
_MEMORY_LENGTHS = flags.DEFINE_list("memory_lengths", ["256", "1024", "2048"],
                                    "Sequence lengths of the one-step statistics memory sweep (empty: skip).")
_MEMORY_WIDTH = flags.DEFINE_integer("memory_width", 512, "Model width of the memory sweep.")
_XLA_CPU_OPTIONS = flags.DEFINE_string("xla_cpu_options", "auto", "XLA CPU option set (dlm_jax.runtime.xla_cpu): "
                                        f"{'|'.join(xla_cpu.CHOICES)}; auto picks by CPU vendor.")
_COMPARE = flags.DEFINE_list("compare_xla_cpu_options", [], "Instead of the sweep: compare these XLA CPU option "
                             "sets (e.g. default,eigen,onednn) in one process per width, batch and condition.")
_COMPARE_CHUNKS = flags.DEFINE_list("compare_query_chunks", [], "With --compare_xla_cpu_options: also compare "
                                    "these query_chunk values (empty: --query_chunk only).")
_COMPARE_FUSED = flags.DEFINE_bool("compare_fused_projections", False, "With --compare_xla_cpu_options: also "
                                   "time every variant with q/k/v and gate/up fused (ModelConfig.fused_projections).")
_ROUNDS = flags.DEFINE_integer("option_rounds", 5, "Rounds of the option comparison (the median counts).")
_JSON_OUT = flags.DEFINE_string("json_out", "denoise_bench.json", "Where to write all results.")
_WORKER = flags.DEFINE_string("worker", None, "Internal: run one measurement described by this JSON.")


def _current_rss_bytes() -> int:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak_rss() -> int:
  """Resets the kernel's peak-RSS mark (VmHWM) to the current RSS and returns that RSS in bytes.

  Called after warm-up, so compilation and one-off allocations do not count towards a run's peak.
  """
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
  return _current_rss_bytes()


def _peak_rss_bytes() -> int:
  """VmHWM: the peak RSS since the last `_reset_peak_rss`."""
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmHWM:"):
        return int(line.split()[1]) * 1024
  raise RuntimeError("VmHWM missing from /proc/self/status")


def _model_config(spec: dict):
  from dlm_jax.config import ModelConfig
  width, heads = spec["width"], spec["heads"]
  return ModelConfig(name=f"bench-{width}", d_model=width, n_layers=spec["layers"], n_heads=heads, n_kv_heads=heads,
                     head_dim=width // heads, mlp_hidden=int(spec["mlp_ratio"] * width), vocab_size=spec["vocab"],
                     rope_theta=500000.0, rope_fp32=True, mask_token_id=spec["vocab"] - 1, eos_token_id=1,
                     eot_token_id=2, bos_token_id=0, pad_token_id=1)


def _inputs(spec: dict):
  """Config, random params (on the default device, in the run's dtype) and a [batch, prompt] prompt."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from dlm_jax import model
  config = _model_config(spec)
  params = model.init_params(config, jax.random.key(0), jnp.dtype(spec["dtype"]))
  prompt = np.random.default_rng(1).integers(3, spec["vocab"] - 1, size=(spec["batch"], spec["prompt"]))
  return config, params, prompt


def _jax_sampler(spec: dict):
  """The run's config, params, prompt [batch, prompt] and `sample(params, prompt) -> Trace` (LLaDA
  low-confidence decoding under the run's condition)."""
  from dlm_jax.instrument.interventions import NO_INTERVENTION, MaskPreviousSinks
  from dlm_jax.sampling.llada import LLaDAOptions, generate
  from dlm_jax.instrument.stats import NO_STATS, StatsSpec
  config, params, prompt = _inputs(spec)
  config = config.replace(fused_projections=spec.get("fused", False))
  options = LLaDAOptions(gen_length=spec["gen"], steps=spec["steps"], block_length=spec["block"])
  stats = NO_STATS if spec["condition"] == "off" else StatsSpec(incoming_attention=True)
  intervention = MaskPreviousSinks(top_k=1) if spec["condition"] == "mask1" else NO_INTERVENTION

  def sample(params, prompt):
    return generate(params, prompt, config=config, options=options,
                    setup=RunSetup(stats_spec=stats, intervention=intervention, attention_impl=spec["impl"],
                                   query_chunk=spec["query_chunk"]))

  return config, params, prompt, sample


def _jax_generation(spec: dict) -> dict:
  import jax
  import numpy as np
  config, params, prompt, sample = _jax_sampler(spec)

  def run():
    return jax.block_until_ready(sample(params, prompt))

  start = time.perf_counter()
  run()
  first = time.perf_counter() - start
  baseline = _reset_peak_rss()
  times = []
  for _ in range(spec["repeats"]):
    start = time.perf_counter()
    trace = run()
    times.append(time.perf_counter() - start)
  steady = min(times)
  generated = np.asarray(trace.generated)
  return {"compile_s": max(first - steady, 0.0), "generation_s": steady,
          "non_eos_tokens": int((generated != config.eos_token_id).sum()),
          "peak_rss_delta_bytes": _peak_rss_bytes() - baseline, "device": str(jax.devices()[0].platform)}


def _torch_sampler(spec: dict, config, params, prompt):
  """The PyTorch way for `spec` with our params and prompt [batch, prompt], warmed up on one block:
  (`sample() -> tokens` [batch, prompt + gen] on the device, the device)."""
  import torch
  from benchmarks import torch_way
  attention = {"off": "sdpa", "stats": "eager", "mask1": "eager_layer_bias"}[spec["condition"]]
  dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[spec["dtype"]]
  device = "cuda" if torch.cuda.is_available() else "cpu"
  model = torch_way.build_model(params, config, attention, dtype=dtype, device=device)
  prompt = torch.as_tensor(prompt, device=device)
  kwargs = dict(gen_length=spec["gen"], steps=spec["steps"], block_length=spec["block"],
                mask_id=config.mask_token_id, statistics=spec["condition"] != "off",
                mask_top_sinks=1 if spec["condition"] == "mask1" else 0)
  steps_per_block = spec["steps"] // (spec["gen"] // spec["block"])
  torch_way.generate(model, prompt, **{**kwargs, "gen_length": spec["block"], "steps": steps_per_block})
  return lambda: torch_way.generate(model, prompt, **kwargs)[0], device


def _torch_generation(spec: dict) -> dict:
  import torch
  config, params, prompt = _inputs(spec)
  sample, device = _torch_sampler(spec, config, params, prompt)
  del params
  baseline = _reset_peak_rss()
  times = []
  for _ in range(spec["repeats"]):
    if device == "cuda":
      torch.cuda.synchronize()
    start = time.perf_counter()
    tokens = sample()
    if device == "cuda":
      torch.cuda.synchronize()
    times.append(time.perf_counter() - start)
  generated = tokens[:, spec["prompt"]:].cpu().numpy()
  result = {"compile_s": 0.0, "generation_s": min(times),
            "non_eos_tokens": int((generated != config.eos_token_id).sum()),
            "peak_rss_delta_bytes": _peak_rss_bytes() - baseline, "device": device}
  if device == "cuda":
    result["peak_device_bytes"] = torch.cuda.max_memory_allocated()
  return result


def _jax_step_memory(spec: dict) -> dict:
  import functools
  import jax
  import numpy as np
  from dlm_jax import model
  from dlm_jax.instrument.stats import StatsSpec
  config, params, _ = _inputs({**spec, "prompt": 1})
  tokens = np.random.default_rng(2).integers(3, spec["vocab"] - 1, size=(1, spec["seq"]))
  window = (spec["seq"] - spec["block"], spec["seq"])  # a step needs the logits of one block, as the sampler
  run = jax.jit(functools.partial(model.forward, config=config,
                                  instruments=model.CallInstruments(stats_spec=StatsSpec(incoming_attention=True)),
                                  readout=model.Readout(window=window),
                                  compute=model.Compute(attention_impl=spec["impl"], query_chunk=spec["query_chunk"])))
  compiled = run.lower(params, tokens).compile()
  baseline = _reset_peak_rss()
  jax.block_until_ready(compiled(params, tokens))
  analysis = compiled.memory_analysis()
  return {"peak_rss_delta_bytes": _peak_rss_bytes() - baseline,
          "xla_temp_bytes": int(getattr(analysis, "temp_size_in_bytes", -1))}


def _torch_step_memory(spec: dict) -> dict:
  import numpy as np
  import torch
  from benchmarks import torch_way
  config, params, _ = _inputs({**spec, "prompt": 1})
  model = torch_way.build_model(params, config, "eager")
  tokens = torch.as_tensor(np.random.default_rng(2).integers(3, spec["vocab"] - 1, size=(1, spec["seq"])))
  visible = torch.zeros(1, 1, spec["seq"], spec["seq"])
  baseline = _reset_peak_rss()
  with torch.no_grad():
    out = model(input_ids=tokens, attention_mask=visible, output_attentions=True)
    torch.stack([a.sum(dim=2) for a in out.attentions])
  return {"peak_rss_delta_bytes": _peak_rss_bytes() - baseline}


def _worker(spec: dict) -> dict:
  """One measurement, with the XLA_FLAGS it ran under."""
  run = {("jax", "generation"): _jax_generation, ("torch", "generation"): _torch_generation,
         ("jax", "step_memory"): _jax_step_memory, ("torch", "step_memory"): _torch_step_memory,
         ("jax", "option_comparison"): lambda spec: option_comparison.run_worker(spec, _jax_sampler, _torch_sampler)}
  return {**run[(spec["framework"], spec["kind"])](spec), "xla_flags": os.environ.get("XLA_FLAGS", "")}


def _measure(spec: dict, xla_flags: str) -> dict:
  """Runs one measurement in a fresh interpreter with XLA_FLAGS=`xla_flags` and returns its JSON result."""
  command = [sys.executable, "-m", "benchmarks.denoise_bench", f"--worker={json.dumps(spec)}"]
  env = {**os.environ, "XLA_FLAGS": xla_flags}
  done = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
  if done.returncode:
    raise RuntimeError(f"measurement {spec} failed:\n{done.stderr[-4000:]}")
  return json.loads(done.stdout.strip().splitlines()[-1])


def matmul_peak() -> dict:
  """FLOP/s of a large GEMM (f32 on CPU, bf16 on GPU) in JAX and in PyTorch; the machine peak is the max."""
  import jax
  import jax.numpy as jnp
  import torch
  on_gpu = jax.devices()[0].platform == "gpu"
  n = 8192 if on_gpu else 2048
  dtype = jnp.bfloat16 if on_gpu else jnp.float32
  a = jnp.ones((n, n), dtype)
  matmul = jax.jit(lambda x: x @ x)
  jax.block_until_ready(matmul(a))
  best = float("inf")
  for _ in range(5):
    start = time.perf_counter()
    jax.block_until_ready(matmul(a))
    best = min(best, time.perf_counter() - start)
  jax_peak = 2 * n ** 3 / best
  device = "cuda" if torch.cuda.is_available() else "cpu"
  t = torch.ones(n, n, dtype=torch.bfloat16 if on_gpu else torch.float32, device=device)
  best = float("inf")
  for _ in range(6):
    if device == "cuda":
      torch.cuda.synchronize()
    start = time.perf_counter()
    t @ t
    if device == "cuda":
      torch.cuda.synchronize()
    best = min(best, time.perf_counter() - start)
  torch_peak = 2 * n ** 3 / best
  return {"gemm_n": n, "dtype": "bfloat16" if on_gpu else "float32", "jax_flops": jax_peak,
          "torch_flops": torch_peak, "peak_flops": max(jax_peak, torch_peak)}


def _write_json(path: str, results: dict) -> None:
  tmp = f"{path}.tmp"
  with open(tmp, "w") as f:
    json.dump(results, f, indent=2)
  os.replace(tmp, path)


def main(argv):
  del argv
  if _WORKER.value:
    print(json.dumps(_worker(json.loads(_WORKER.value))))
    return
  unknown = [name for name in _COMPARE.value if name not in xla_cpu.OPTION_SETS]
  if unknown:
    sys.exit(f"benchmarks.denoise_bench: error: --compare_xla_cpu_options: unknown set {unknown[0]!r}; expected "
             f"some of {', '.join(xla_cpu.OPTION_SETS)}")
  if not all(c.isdigit() and int(c) > 0 for c in _COMPARE_CHUNKS.value):
    sys.exit(f"benchmarks.denoise_bench: error: --compare_query_chunks={','.join(_COMPARE_CHUNKS.value)}: "
             "expected positive integers")
  try:
    options = None if _COMPARE.value else xla_cpu.apply(_XLA_CPU_OPTIONS.value)
  except ValueError as e:
    sys.exit(f"benchmarks.denoise_bench: error: --xla_cpu_options={_XLA_CPU_OPTIONS.value}: {e}")
  cpu = xla_cpu.cpu_info()
  import jax  # pylint: disable=import-outside-toplevel  (after XLA_FLAGS is set)
  import jaxlib  # pylint: disable=import-outside-toplevel
  versions = {"jax_version": jax.__version__, "jaxlib_version": jaxlib.__version__}
  print(f"CPU: {cpu.model} ({cpu.vendor}); jax {jax.__version__}, jaxlib {jaxlib.__version__}; load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
  steps = _STEPS.value or _GEN.value
  base = dict(layers=_LAYERS.value, heads=_HEADS.value, mlp_ratio=_MLP_RATIO.value, vocab=_VOCAB.value,
              prompt=_PROMPT.value, gen=_GEN.value, block=_BLOCK.value, steps=steps, dtype=_DTYPE.value,
              impl=_IMPL.value, query_chunk=_QUERY_CHUNK.value, repeats=2)
  if _COMPARE.value:
    chunks = [int(c) for c in _COMPARE_CHUNKS.value] or [_QUERY_CHUNK.value]
    grid = dict(widths=list(map(int, _WIDTHS.value)), batches=list(map(int, _BATCH.value)),
                conditions=_CONDITIONS.value, torch="torch" in _FRAMEWORKS.value, rounds=_ROUNDS.value,
                variants=option_comparison.variants(_COMPARE.value, chunks, [False, True] if _COMPARE_FUSED.value
                                                    else [False]))
    header = {"cpu": dataclasses.asdict(cpu), **versions, "load_average": os.getloadavg(),
              "xla_flags": os.environ.get("XLA_FLAGS", ""),
              "sets": {name: dict(xla_cpu.OPTION_SETS[name]) for name in _COMPARE.value}}
    option_comparison.compare(base, grid, lambda spec: _measure(spec, os.environ.get("XLA_FLAGS", "")), header,
                              _write_json, _JSON_OUT.value)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return
  print(f"XLA CPU options: {options.name} (--xla_cpu_options={options.choice}); "
        f"XLA_FLAGS={options.xla_flags or '(empty)'}")
  peak = matmul_peak()
  print(f"matmul peak ({peak['dtype']} GEMM n={peak['gemm_n']}): JAX {peak['jax_flops'] / 1e9:.1f} GFLOP/s, "
        f"PyTorch {peak['torch_flops'] / 1e9:.1f} GFLOP/s")
  print("step FLOPs = L·(2·S·D·3·N·H + 2·S·N·H·D + 6·S·D·F + 4·S²·N·H) + 2·W·D·V, W = block length")
  results = {"cpu": dataclasses.asdict(cpu), **versions, "load_average": os.getloadavg(),
             "xla_cpu_options": dataclasses.asdict(options),
             "matmul_peak": peak, "generation": [], "step_memory": [], "flags": {
      "layers": _LAYERS.value, "heads": _HEADS.value, "mlp_ratio": _MLP_RATIO.value, "vocab": _VOCAB.value,
      "prompt": _PROMPT.value, "gen": _GEN.value, "block": _BLOCK.value, "steps": steps, "dtype": _DTYPE.value,
      "attention_impl": _IMPL.value, "query_chunk": _QUERY_CHUNK.value}}
  header = (f"{'width':>5} {'batch':>5} {'condition':>9} {'framework':>9} {'compile s':>9} {'ms/step':>8} "
            f"{'tok/s':>8} {'GFLOP/s':>8} {'% peak':>6} {'peak MB':>8}")
  print(header)
  for width in map(int, _WIDTHS.value):
    for batch in map(int, _BATCH.value):
      seq = _PROMPT.value + _GEN.value
      flops = batch * step_flops(width, _LAYERS.value, _HEADS.value, int(_MLP_RATIO.value * width), _VOCAB.value,
                                 seq, _BLOCK.value)
      for condition in _CONDITIONS.value:
        row = {}
        for framework in _FRAMEWORKS.value:
          spec = dict(base, width=width, batch=batch, condition=condition, framework=framework, kind="generation")
          measured = _measure(spec, options.xla_flags)
          step_s = measured["generation_s"] / steps
          measured.update(width=width, batch=batch, condition=condition, framework=framework, step_flops=flops,
                          ms_per_step=1e3 * step_s, tokens_per_s=measured["non_eos_tokens"] / measured["generation_s"],
                          flops_per_s=flops / step_s, peak_fraction=flops / step_s / peak["peak_flops"])
          results["generation"].append(measured)
          row[framework] = measured
          print(f"{width:>5} {batch:>5} {condition:>9} {framework:>9} {measured['compile_s']:>9.2f} "
                f"{measured['ms_per_step']:>8.2f} {measured['tokens_per_s']:>8.1f} "
                f"{measured['flops_per_s'] / 1e9:>8.1f} {100 * measured['peak_fraction']:>6.1f} "
                f"{measured['peak_rss_delta_bytes'] / 2**20:>8.1f}", flush=True)
        if "jax" in row and "torch" in row:
          ratio = row["torch"]["ms_per_step"] / row["jax"]["ms_per_step"]
          results["generation"][-1]["jax_speedup"] = ratio
          print(f"{'':>5} {'':>5} {condition:>9} {'speedup':>9} dlm_jax is {ratio:.2f}x the PyTorch way")
      _write_json(_JSON_OUT.value, results)
  off = {(r["width"], r["batch"], r["framework"]): r for r in results["generation"] if r["condition"] == "off"}
  for r in results["generation"]:
    if r["framework"] == "jax" and r["condition"] != "off" and (r["width"], r["batch"], "jax") in off:
      overhead = r["ms_per_step"] / off[(r["width"], r["batch"], "jax")]["ms_per_step"] - 1
      print(f"width {r['width']} batch {r['batch']}: '{r['condition']}' costs {100 * overhead:+.1f}% step time "
            "over statistics off (dlm_jax)")
  for seq in map(int, [v for v in _MEMORY_LENGTHS.value if v]):
    for framework in _FRAMEWORKS.value:
      spec = dict(base, width=_MEMORY_WIDTH.value, batch=1, seq=seq, framework=framework, kind="step_memory")
      measured = _measure(spec, options.xla_flags)
      measured.update(seq=seq, framework=framework, width=_MEMORY_WIDTH.value)
      results["step_memory"].append(measured)
      extra = f", XLA temp {measured['xla_temp_bytes'] / 2**20:.1f} MB" if "xla_temp_bytes" in measured else ""
      print(f"one statistics step, S={seq}, width {_MEMORY_WIDTH.value}, {framework}: peak RSS +"
            f"{measured['peak_rss_delta_bytes'] / 2**20:.1f} MB{extra}", flush=True)
    _write_json(_JSON_OUT.value, results)
  _write_json(_JSON_OUT.value, results)
  print(f"results written to {_JSON_OUT.value}")


if __name__ == "__main__":
  app.run(main)
