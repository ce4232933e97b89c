"""The denoising benchmark's option comparison: XLA CPU option sets, query blocks and fused projections
timed against each other and against the PyTorch way, interleaved in one process.

A variant is (XLA CPU option set, query_chunk, fused projections or not). One worker process per width,
batch and condition traces the sampler once per (query_chunk, fused) pair, compiles it once per option
set (`compile(compiler_options=...)`, the same DebugOptions fields XLA_FLAGS sets), builds the PyTorch
way, then runs `rounds` rounds in which every variant and the PyTorch way decode once in turn, so load
from other processes falls on all of them alike. Each gets the median and the best of its rounds, and
whether it decoded the same tokens as the first variant.
"""

from __future__ import annotations

import itertools
import statistics
import time

from dlm_jax.runtime import xla_cpu


def variants(sets: list[str], query_chunks: list[int], fused: list[bool]) -> list[dict]:
  """Every (set, query_chunk, fused) combination, named "set", "set/qc128", "set/fused", "set/qc128/fused"
  (the query chunk named only when more than one is compared)."""
  out = []
  for fuse, chunk, name in itertools.product(fused, query_chunks, sets):
    label = name + (f"/qc{chunk}" if len(query_chunks) > 1 else "") + ("/fused" if fuse else "")
    out.append({"name": label, "set": name, "query_chunk": chunk, "fused": fuse})
  return out


def run_worker(spec: dict, jax_sampler, torch_sampler) -> dict:
  """Times spec["variants"] (and the PyTorch way when spec["torch"]) for spec["rounds"] rounds.

  jax_sampler(spec) -> (config, params, prompt, sample) and torch_sampler(spec, config, params, prompt)
  -> (sample, device) are the benchmark's. Returns {name: {generation_s (median), best_s, non_eos_tokens,
  same_tokens}}.
  """
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  runs, lowered = {}, {}
  for variant in spec["variants"]:
    key = (variant["query_chunk"], variant["fused"])
    if key not in lowered:
      config, params, prompt, sample = jax_sampler({**spec, "query_chunk": variant["query_chunk"],
                                                    "fused": variant["fused"]})
      lowered[key] = jax.jit(sample).lower(params, prompt)
    compiled = lowered[key].compile(compiler_options=xla_cpu.OPTION_SETS[variant["set"]] or None)
    runs[variant["name"]] = lambda c=compiled: np.asarray(jax.block_until_ready(c(params, prompt)).generated)
  if spec["torch"]:
    torch_sample = torch_sampler(spec, config, params, prompt)[0]
    runs["torch"] = lambda: torch_sample()[:, spec["prompt"]:].cpu().numpy()
  tokens = {name: run() for name, run in runs.items()}
  times = {name: [] for name in runs}
  for _ in range(spec["rounds"]):
    for name, run in runs.items():
      start = time.perf_counter()
      run()
      times[name].append(time.perf_counter() - start)
  first = tokens[spec["variants"][0]["name"]]
  return {name: {"generation_s": statistics.median(times[name]), "best_s": min(times[name]),
                 "non_eos_tokens": int((tokens[name] != config.eos_token_id).sum()),
                 "same_tokens": bool(np.array_equal(tokens[name], first))} for name in runs}


def compare(base: dict, grid: dict, measure, header: dict, write_json, json_out: str) -> dict:
  """Runs the comparison for every width x batch x condition of `grid` (with "variants", "torch",
  "rounds"), prints one row per variant (median ms/step, tokens/s, ratio to the PyTorch way, same tokens),
  writes `header` plus the rows to `json_out` after each worker; measure(spec) runs one worker."""
  results = {**header, "variants": grid["variants"], "flags": base, "option_comparison": []}
  print(f"{'width':>5} {'batch':>5} {'condition':>9} {'variant':>22} {'ms/step':>8} {'best':>8} {'tok/s':>8} "
        f"{'vs torch':>8} {'tokens':>9}")
  for width, batch, condition in itertools.product(grid["widths"], grid["batches"], grid["conditions"]):
    spec = dict(base, width=width, batch=batch, condition=condition, framework="jax", kind="option_comparison",
                variants=grid["variants"], torch=grid["torch"], rounds=grid["rounds"])
    measured = measure(spec)
    measured.pop("xla_flags", None)  # the worker's environment (the sets are compiler options)
    torch_s = measured["torch"]["generation_s"] if "torch" in measured else None
    for name, row in measured.items():
      row.update(width=width, batch=batch, condition=condition, variant=name,
                 ms_per_step=1e3 * row["generation_s"] / base["steps"],
                 tokens_per_s=row["non_eos_tokens"] / row["generation_s"])
      if torch_s and name != "torch":
        row["jax_speedup"] = torch_s / row["generation_s"]
      results["option_comparison"].append(row)
      ratio = f"{row['jax_speedup']:.2f}x" if "jax_speedup" in row else ""
      print(f"{width:>5} {batch:>5} {condition:>9} {name:>22} {row['ms_per_step']:>8.2f} "
            f"{1e3 * row['best_s'] / base['steps']:>8.2f} {row['tokens_per_s']:>8.1f} {ratio:>8} "
            f"{'same' if row['same_tokens'] else 'DIFFERENT':>9}", flush=True)
    write_json(json_out, results)
  print(f"results written to {json_out}")
  return results
