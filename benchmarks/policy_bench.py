r"""Compute-policy benchmark: what one sampler step of every runnable compute policy costs at the LLaDA-8B layer
shape, against the exact sampler and Fast-dLLM's dual cache, in one run — with exact decoding, and combined with
Fast-dLLM's threshold decoding (a derived figure, below).

    python -m benchmarks.policy_bench                                   # 2 layers, prompts 512 and 1024 + 256
    python -m benchmarks.policy_bench --layers=32 --dtype=bfloat16   # a GPU (benchmarks/gpu_bench.sh)

Model: `llada-8b`'s config (d 4096, 32 heads, MLP 12288, vocabulary 126464) with --layers layers and random
weights, batch 1. Each step of a 256-token generation in blocks of 32 is one of a few model calls
(`benchmarks.policy_calls` lists them: the exact call, the refresh call, each method's skipping calls); the
benchmark compiles each call once and times it (the median of --repeats runs after a warm-up). FLOPs: the
analytic count of each call (`dlm_jax.policy.cost`), checked against XLA's cost analysis of the same call
compiled with dense attention for one layer (XLA counts the body of a loop once, so a scan over layers is counted
whole only at one layer; dLLM-Cache's calls at two, `policy_calls.check_layers`).

Exact decoding (one token per step, 256 steps): a method's step is its schedule's mean over its calls
(`benchmarks.policy_schedules`: fixed schedules counted at the benchmark's layout, dKV-Cache's row bucket from the
positions masked at each step; Elastic-Cache's refresh share and d2Cache's query-row buckets measured on the
embedded tiny-dlm under exact decoding); tokens/s = 1 / step time.

Threshold decoding (derived): random weights give no meaningful confidences, so the tokens a call commits under
Fast-dLLM's threshold rule (--threshold) and the mix of each method's calls under it are measured on the embedded
tiny-dlm (`benchmarks.policy_call_mix`; 32 generated positions in one block of 32, --mix_prompts problems), and
combined with the per-call times measured here: tokens/s = tokens per call / Σ_call share × ms. A tiny-dlm run is
one block, so the per-block calls (Fast-dLLM's refresh, Sparse-dLLM's two full calls) keep their share; d2Cache's
and Elastic-Cache's first full call comes once per run, so their mix is that call once over the
benchmark's --gen_length / (tokens per call) calls and the tiny runs' later calls' mix for the rest
(`RUN_FIRST_CALL`); dKV-Cache's cached calls, whose count holds every later block's masks, are spread over the
benchmark's blocks, each block's at the bucket of its largest count (`policy_schedules.dkv_by_block`). Both inputs
are printed and written. The baselines: the exact sampler's tokens/s (one token
per call) and Fast-dLLM's threshold + dual cache derived the same way. A policy the threshold sampler refuses is
listed with the refusal.

The CPU model and the load average are printed; results go to --json_out, rewritten after each prompt length.

--calls_from=JSON reuses an earlier run's per-call measurements (its "calls", its CPU and load recorded under
"calls_from") and measures only the call mixes again: the mixes are counts on tiny-dlm, the same on any machine,
so every ratio still divides times of one run. Use it when a policy gains a decoding mode whose calls the earlier
run already timed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time

from absl import app, flags

from benchmarks.machine import cpu_model

_PRESET = flags.DEFINE_string("preset", "llada-8b", "The `dlm_jax.config` preset whose shape is measured.")
_LAYERS = flags.DEFINE_integer("layers", 2, "Transformer layers of that shape.")
_PROMPTS = flags.DEFINE_list("prompt_lengths", ["512", "1024"], "Prompt lengths.")
_GEN = flags.DEFINE_integer("gen_length", 256, "Generated positions.")
_BLOCK = flags.DEFINE_integer("block_length", 32, "Block length.")
_KEEP = flags.DEFINE_float("keep_ratio", 0.5, "Sparse-dLLM's keep ratio.")
_RELOAD = flags.DEFINE_integer("cache_reloading_step", 8, "dKV-Cache's refresh interval within a block.")
_SPARSED = flags.DEFINE_string("sparsed", "sparsed", "SparseD's policy text (published defaults: skip 0.2, select "
                               "0.3, block_size 128).")
_DLLM_CACHE = flags.DEFINE_string("dllm_cache", "dllm_cache", "dLLM-Cache's policy text (published defaults: "
                                  "prompt_interval_steps 50, gen_interval_steps 7, transfer_ratio 0.25).")
_ELASTIC = flags.DEFINE_string("elastic_cache", "elastic_cache:window_length=32", "Elastic-Cache's policy text "
                               "(published gamma 0.9, track_num 1; window_length 32, the smallest a block of 32 "
                               "allows with block caching).")
_D2CACHE = flags.DEFINE_string("d2cache", "d2cache", "d2Cache's policy text (published defaults).")
_THRESHOLD = flags.DEFINE_float("threshold", 0.9, "Fast-dLLM's confidence threshold of the derived figures.")
_MIX_PROMPTS = flags.DEFINE_integer("mix_prompts", 16, "tiny-dlm problems the call mixes and tokens per call are "
                                    "measured on (0: no derived figures, no Elastic-Cache or d2Cache step).")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Weights and activations dtype.")
_IMPL = flags.DEFINE_enum("attention_impl", "chunked", ["chunked", "dense", "fused"], "Attention path.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed runs per call after one warm-up; the median is reported.")
_JSON_OUT = flags.DEFINE_string("json_out", "policy_bench.json", "Where to write the results.")
_CALLS_FROM = flags.DEFINE_string("calls_from", None, "An earlier run's --json_out whose per-call times and FLOPs "
                                  "are reused instead of measured (same preset, layers, dtype, lengths and "
                                  "policies): only the tiny-dlm call mixes are measured again.")

NAME = "benchmarks.policy_bench"


def fail(message: str) -> None:
  """One line on stderr, exit code 1."""
  sys.exit(f"{NAME}: error: {message}")


def policy_texts() -> dict[str, str]:
  """{method: policy text} of the measured policies (the flags)."""
  return {"dkv_cache": f"dkv_cache:cache_reloading_step={_RELOAD.value}",
          "sparse_dllm": f"sparse_dllm:keep_ratio={_KEEP.value}", "sparsed": _SPARSED.value,
          "dllm_cache": _DLLM_CACHE.value, "elastic_cache": _ELASTIC.value, "d2cache": _D2CACHE.value}


def checked_settings():
  """(prompt lengths, {method: policy}) with every flag checked, one line per problem, before any model work."""
  from dlm_jax.policy.registry import parse_policy  # pylint: disable=import-outside-toplevel
  try:
    prompts = [int(p) for p in _PROMPTS.value]
  except ValueError:
    fail(f"--prompt_lengths={','.join(_PROMPTS.value)}: expected positive integers")
  for name, value in (("gen_length", _GEN.value), ("block_length", _BLOCK.value), ("layers", _LAYERS.value),
                      ("repeats", _REPEATS.value)):
    if value < 1:
      fail(f"--{name}={value}: expected a positive integer")
  if not prompts or min(prompts) < 1:
    fail(f"--prompt_lengths={','.join(_PROMPTS.value)}: expected positive integers")
  if _GEN.value % _BLOCK.value or _GEN.value < 4 * _BLOCK.value:
    fail(f"--gen_length={_GEN.value}: expected a multiple of --block_length={_BLOCK.value}, at least 4 blocks (the "
         "timed calls decode the fourth)")
  if _MIX_PROMPTS.value < 0:
    fail(f"--mix_prompts={_MIX_PROMPTS.value}: expected >= 0")
  if not 0 < _THRESHOLD.value <= 1:
    fail(f"--threshold={_THRESHOLD.value}: expected a value in (0, 1]")
  policies = {}
  for method, text in policy_texts().items():
    try:
      policy = parse_policy(text)
    except ValueError as error:
      flag = {"dkv_cache": "cache_reloading_step", "sparse_dllm": "keep_ratio"}.get(method, method)
      fail(f"--{flag}: {text}: {error}")
    if policy.NAME != method:
      fail(f"--{method}={text}: expected a {method} policy, got {policy.NAME}")
    policies[method] = policy
  from benchmarks.policy_calls import layout  # pylint: disable=import-outside-toplevel
  for method, policy in policies.items():
    for prompt_length in prompts:
      try:
        policy.bind(layout(prompt_length, _GEN.value, _BLOCK.value)).check(None, None)
      except ValueError as error:
        fail(f"{policy_texts()[method]} at prompt {prompt_length} + {_GEN.value} in blocks of {_BLOCK.value}: {error}")
  return prompts, policies


def main(argv: list[str]) -> None:
  del argv
  prompts, policies = checked_settings()
  earlier = earlier_calls(prompts, policies["dkv_cache"]) if _CALLS_FROM.value else None
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  from benchmarks import policy_calls, policy_schedules  # pylint: disable=import-outside-toplevel
  from dlm_jax.config import preset  # pylint: disable=import-outside-toplevel

  dtype = jnp.float32 if _DTYPE.value == "float32" else jnp.bfloat16
  config = dataclasses.replace(preset(_PRESET.value), n_layers=_LAYERS.value)
  methods = policy_calls.Methods(_KEEP.value, policies["sparsed"], policies["dllm_cache"], policies["elastic_cache"],
                                 policies["d2cache"], policies["dkv_cache"])
  g, block = _GEN.value, _BLOCK.value
  print(f"CPU: {cpu_model()}; device: {jax.devices()[0].platform}; {config.n_layers} layers of {_PRESET.value}, "
        f"{_DTYPE.value}; load average {os.getloadavg()[0]:.1f}", flush=True)
  results = {"cpu": cpu_model(), "device": jax.devices()[0].platform, "preset": _PRESET.value,
             "layers": config.n_layers, "dtype": _DTYPE.value, "gen_length": g, "block_length": block,
             "repeats": _REPEATS.value, "policies": policy_texts(), "load_average_start": os.getloadavg()[0],
             "prompts": {}}

  if earlier is not None:
    results["calls_from"] = {key: earlier[key] for key in ("cpu", "load_average_start", "load_average_end")}
    results["calls_from"]["path"] = _CALLS_FROM.value
    results["repeats"] = earlier["repeats"]
    print(f"per-call times from {_CALLS_FROM.value} (CPU: {earlier['cpu']}; load average "
          f"{earlier['load_average_start']:.1f}); measuring the call mixes only", flush=True)
  mixes = measure_mixes(policies) if _MIX_PROMPTS.value else None
  if mixes is not None:
    results["call_mix"] = mixes
  timer = None if earlier is not None else CallTimer(config, dtype)
  for prompt_length in prompts:
    if earlier is not None:
      measured = earlier["prompts"][str(prompt_length)]["calls"]
    else:
      measured = timer.measure(prompt_length, methods)
    dkv_buckets = policies["dkv_cache"].bind(policy_calls.layout(prompt_length, g, block)).buckets
    schedules = policy_schedules.exact_decoding(g, block, _RELOAD.value, methods.sparsed, methods.dllm_cache,
                                                dkv_buckets)
    if mixes is not None:
      for method, first in RUN_FIRST_CALL.items():
        if "mix" in mixes[f"{method} exact"]:
          schedules[method] = policy_schedules.measured(first, mixes[f"{method} exact"]["mix_after_first"], g)
    steps = {method: {"mix": mix, "ms": policy_schedules.mean(mix, measured, "ms"),
                      "flops": policy_schedules.mean(mix, measured, "flops")} for method, mix in schedules.items()}
    print(f"prompt {prompt_length} + {g}, exact decoding (one token per step): per step")
    for method, step in steps.items():
      print(f"  {method:14s} {step['ms']:10.1f} ms/step  {step['flops'] / 1e9:9.1f} GFLOP/step  "
            f"{1e3 / step['ms']:7.3f} tokens/s  {steps['exact']['ms'] / step['ms']:5.2f}x exact  "
            f"{steps['dual_cache']['ms'] / step['ms']:5.2f}x dual cache   mix {fmt(step['mix'])}", flush=True)
    worst = max(measured, key=lambda n: abs(measured[n]["xla_flops_check"] / measured[n]["analytic_flops_check"] - 1))
    gap = measured[worst]["xla_flops_check"] / measured[worst]["analytic_flops_check"] - 1
    print(f"  Goal: XLA's count within 10% of the analytic one: largest gap {gap:+.1%} ({worst}); sparse_dllm at "
          f"keep ratio {_KEEP.value}: {steps['exact']['ms'] / steps['sparse_dllm']['ms']:.2f}x exact decoding "
          "(goal >= 1.5 at prompt 1024)", flush=True)
    results["prompts"][prompt_length] = {"calls": measured, "exact_decoding": steps}
    if mixes is not None:
      results["prompts"][prompt_length]["threshold_decoding"] = threshold_figures(mixes, measured, steps,
                                                                                  dkv_buckets)
    results["load_average_end"] = os.getloadavg()[0]
    write(results)
  print(f"load average at the end {results['load_average_end']:.1f}; wrote {_JSON_OUT.value}")


class CallTimer:
  """Times the calls of `benchmarks.policy_calls` at --layers layers of `config` (random weights of `dtype`), each
  compiled once, and counts each call's FLOPs with XLA at one or two layers (dense attention)."""

  def __init__(self, config, dtype):
    import jax  # pylint: disable=import-outside-toplevel

    from dlm_jax.model import init_params  # pylint: disable=import-outside-toplevel
    cast = lambda tree: jax.tree.map(lambda a: a.astype(dtype), tree)  # noqa: E731
    self.config, self.dtype = config, dtype
    self.params = cast(init_params(config, jax.random.key(0)))
    self.checks = {n: dataclasses.replace(config, n_layers=n) for n in (1, 2)}
    self.check_params = {n: jax.eval_shape(lambda c=c: cast(init_params(c, jax.random.key(0))))
                         for n, c in self.checks.items()}
    self.compiled = {}

  def timed(self, call) -> float:
    """The median seconds of --repeats runs of `call` after a warm-up."""
    import jax  # pylint: disable=import-outside-toplevel
    if call.fn not in self.compiled:
      self.compiled[call.fn] = jax.jit(call.fn).lower(*call.args).compile()
    program = self.compiled[call.fn]
    jax.block_until_ready(program(*call.args))
    runs = []
    for _ in range(_REPEATS.value):
      begin = time.perf_counter()
      jax.block_until_ready(program(*call.args))
      runs.append(time.perf_counter() - begin)
    return statistics.median(runs)

  def measure(self, prompt_length: int, methods) -> dict[str, dict]:
    """{call: {"ms", "flops", "check_layers", "xla_flops_check", "analytic_flops_check"}}: every call of
    `benchmarks.policy_calls` at prompt_length + --gen_length, timed, and XLA's FLOP count of the same call at
    `check_layers` layers with dense attention against the analytic one (printed)."""
    import jax  # pylint: disable=import-outside-toplevel

    from benchmarks import policy_calls  # pylint: disable=import-outside-toplevel
    s = prompt_length + _GEN.value
    config, dtype = self.config, self.dtype
    tokens = jax.random.randint(jax.random.key(1), (1, s), 0, config.vocab_size)
    check = {n: policy_calls.make_calls(self.checks[n], "dense", self.check_params[n], tokens, prompt_length,
                                        _BLOCK.value, methods, dtype) for n in self.checks}
    measured, xla_counted = {}, {}
    for name, call in policy_calls.make_calls(config, _IMPL.value, self.params, tokens, prompt_length, _BLOCK.value,
                                              methods, dtype).items():
      seconds = self.timed(call)
      layers = policy_calls.check_layers(name)
      counted = check[layers][name]
      if counted.fn not in xla_counted:
        xla_counted[counted.fn] = jax.jit(counted.fn).lower(*counted.args).compile().cost_analysis()["flops"]
      # A lax.cond per layer (Elastic-Cache): XLA counts the larger branch, the full refresh.
      reference = check[layers]["elastic_full_refresh" if name == "elastic_no_refresh" else name].flops
      xla = xla_counted[counted.fn]
      measured[name] = {"ms": seconds * 1e3, "flops": call.flops, "check_layers": layers, "xla_flops_check": xla,
                        "analytic_flops_check": reference}
      print(f"  S={s} {name:22s} {seconds * 1e3:10.1f} ms  {call.flops / 1e9:9.1f} GFLOP (analytic)  {layers} "
            f"layer(s): XLA {xla / 1e9:.2f} vs analytic {reference / 1e9:.2f} GFLOP ({xla / reference - 1:+.1%})"
            + ("  [the full-refresh branch]" if name == "elastic_no_refresh" else ""), flush=True)
    return measured


def earlier_calls(prompts: list[int], dkv_cache) -> dict:
  """The --calls_from run's results, after checking that it measured this run's calls (one line otherwise; e.g. a
  run from before dKV-Cache's row buckets, `dkv_cache` the policy, has no call at its smaller buckets)."""
  try:
    with open(_CALLS_FROM.value, encoding="utf-8") as f:
      earlier = json.load(f)
  except (OSError, ValueError) as error:
    fail(f"--calls_from={_CALLS_FROM.value}: not a readable benchmark JSON ({error})")
  wanted = {"preset": _PRESET.value, "layers": _LAYERS.value, "dtype": _DTYPE.value, "gen_length": _GEN.value,
            "block_length": _BLOCK.value}
  for key, value in wanted.items():
    if earlier.get(key) != value:
      fail(f"--calls_from={_CALLS_FROM.value}: its {key} is {earlier.get(key)!r}, this run's {value!r}")
  if earlier.get("policies") != policy_texts():
    fail(f"--calls_from={_CALLS_FROM.value}: it measured policies {earlier.get('policies')}, this run "
         f"{policy_texts()}")
  missing = [p for p in prompts if str(p) not in earlier.get("prompts", {})]
  if missing:
    fail(f"--calls_from={_CALLS_FROM.value}: no calls measured at prompt length(s) {missing}")
  from benchmarks import policy_schedules  # pylint: disable=import-outside-toplevel
  from benchmarks.policy_calls import layout  # pylint: disable=import-outside-toplevel
  for p in prompts:
    buckets = dkv_cache.bind(layout(p, _GEN.value, _BLOCK.value)).buckets
    absent = sorted({policy_schedules.dkv_call(buckets, rows) for rows in buckets} - set(earlier["prompts"][str(p)]
                                                                                         ["calls"]))
    if absent:
      fail(f"--calls_from={_CALLS_FROM.value}: no {', '.join(absent)} measured at prompt {p} (a run from before "
           "dKV-Cache's row buckets); run without --calls_from")
  return earlier


def write(results: dict) -> None:
  """The results so far to --json_out (temp + rename; after each prompt length)."""
  with open(_JSON_OUT.value + ".tmp", "w", encoding="utf-8") as f:
    json.dump(results, f, indent=1)
  os.replace(_JSON_OUT.value + ".tmp", _JSON_OUT.value)


def fmt(mix: dict[str, float]) -> str:
  """A call mix as 'call share, ...'."""
  return ", ".join(f"{call} {weight:.3f}" for call, weight in mix.items())


def measure_mixes(policies) -> dict[str, dict]:
  """{label: tiny-dlm call mix} (`benchmarks.policy_call_mix`): every method and no policy under the threshold
  rule, Fast-dLLM's threshold + dual cache, and Elastic-Cache and d2Cache under exact decoding."""
  from benchmarks import policy_call_mix as mix  # pylint: disable=import-outside-toplevel
  tau = _THRESHOLD.value
  conditions = {"none threshold": mix.Condition("none", tau),
                "dual_cache threshold": mix.Condition("none", tau, "dual")}
  conditions.update({f"{m} threshold": mix.Condition(policy_texts()[m], tau) for m in policies})
  if "sparse_dllm" in policies:  # the one policy that composes with the dual cache
    conditions["sparse_dllm_dual_cache threshold"] = mix.Condition(policy_texts()["sparse_dllm"], tau, "dual")
  conditions.update({f"{m} exact": mix.Condition(policy_texts()[m]) for m in ("elastic_cache", "d2cache")})
  print(f"tiny-dlm call mixes ({_MIX_PROMPTS.value} problems, 32 positions in one block of 32):", flush=True)
  measured = mix.measure(list(conditions.values()), _MIX_PROMPTS.value)
  out = {}
  for label, condition in conditions.items():
    out[label] = measured[condition]
    row = measured[condition]
    line = (f"refused: {row['refused']}" if "refused" in row else
            f"{row['tokens_per_call']:.2f} tokens/call ({row['calls']} calls)  mix {fmt(row['mix'])}")
    print(f"  {label:24s} {line}", flush=True)
  return out


RUN_FIRST_CALL = {"elastic_cache": "elastic_full_refresh", "d2cache": "full"}
"""The methods whose full call comes once per run, not once per block: their tiny-dlm mixes (one block) are put on
the benchmark's generation as that first call once plus the later calls' mix (`policy_schedules.measured`)."""


def threshold_figures(mixes: dict[str, dict], measured: dict[str, dict], steps: dict[str, dict],
                      dkv_buckets: tuple[int, ...]) -> dict[str, dict]:
  """{method: derived threshold-decoding figures} (module docstring), printed with the Goal's two ratios;
  dkv_buckets: dKV-Cache's buckets at the benchmark's layout (its one-block mix put on the blocks,
  `policy_schedules.dkv_by_block`)."""
  from benchmarks import policy_schedules  # pylint: disable=import-outside-toplevel
  exact_tps = 1e3 / steps["exact"]["ms"]
  figures = {}
  for label, row in mixes.items():
    if not label.endswith(" threshold"):
      continue
    method = label[:-len(" threshold")]
    if "refused" in row:
      figures[method] = {"refused": row["refused"]}
      continue
    mix = row["mix"]
    if method in RUN_FIRST_CALL:  # one first call over the benchmark's G / (tokens per call) calls
      calls = _GEN.value / row["tokens_per_call"]
      mix = policy_schedules.measured(RUN_FIRST_CALL[method], row["mix_after_first"], calls)
    if method == "dkv_cache":  # its cached calls' bucket follows the block (the later blocks' masks count)
      mix = policy_schedules.dkv_by_block(mix, _GEN.value, _BLOCK.value, dkv_buckets)
    ms = policy_schedules.mean(mix, measured, "ms")
    figures[method] = {"tokens_per_call": row["tokens_per_call"], "mix": mix, "ms_per_call": ms,
                       "flops_per_call": policy_schedules.mean(mix, measured, "flops"),
                       "tokens_per_s": row["tokens_per_call"] * 1e3 / ms}
  dual = figures["dual_cache"]["tokens_per_s"]
  print(f"  threshold {_THRESHOLD.value} (derived: tiny-dlm tokens per call and call mix x these per-call times); "
        f"exact sampler {exact_tps:.3f} tokens/s")
  for method, figure in figures.items():
    if "refused" in figure:
      print(f"  {method:14s} refused: {figure['refused']}")
      continue
    figure["x_exact_sampler"] = figure["tokens_per_s"] / exact_tps
    figure["x_threshold_dual_cache"] = figure["tokens_per_s"] / dual
    print(f"  {method:14s} {figure['tokens_per_call']:5.2f} tokens/call  {figure['ms_per_call']:10.1f} ms/call  "
          f"{figure['tokens_per_s']:7.3f} tokens/s  {figure['x_exact_sampler']:5.2f}x exact sampler  "
          f"{figure['x_threshold_dual_cache']:5.2f}x threshold + dual cache", flush=True)
  best = max((m for m in figures if "refused" not in figures[m] and m not in ("none", "dual_cache")),
             key=lambda m: figures[m]["tokens_per_s"], default=None)
  if best is not None:
    print(f"  Goal: best policy + threshold ({best}) {figures[best]['x_exact_sampler']:.2f}x the exact sampler "
          f"(goal >= 10) and {figures[best]['x_threshold_dual_cache']:.2f}x threshold + dual cache (goal >= 2)")
  return figures


if __name__ == "__main__":
  app.run(main)
