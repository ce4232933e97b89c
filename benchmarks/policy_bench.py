r"""Compute-policy benchmark: what one sampler step of each policy costs at the LLaDA-8B layer shape, against the
exact sampler and Fast-dLLM's dual cache, in one run.

    python -m benchmarks.policy_bench                                   # 2 layers, prompts 512 and 1024 + 256
    python -m benchmarks.policy_bench --layers=32 --dtype=bfloat16 --attention_impl=fused   # a GPU

Model: `llada-8b`'s config (d 4096, 32 heads, MLP 12288, vocabulary 126464) with --layers layers and random
weights. Each step of a 256-token generation in blocks of 32 (256 steps, one token per step) is one of a few
model calls; the benchmark compiles each call once and times it (the median of --repeats runs after a warm-up):

  exact            the whole sequence through the trunk, the LM head on the current block (LLaDA's sampler);
  full             the same with the policy's KV cache written (a policy's refresh call);
  dkv_subset       dKV-Cache's cached call: the G generated positions (its static budget) through the trunk
                   reading all S cached keys, the LM head on the block;
  sparse_subset    Sparse-dLLM's call at a block's steps >= 2: the block's 32 queries, each layer reading its
                   int((S − 32) × keep_ratio) kept keys and the block;
  dual_cache       Fast-dLLM's dual cache: the block's queries reading all S cached keys (its refresh is a
                   `full` call at each block start).

A method's step cost is its schedule's mean over the 32 steps of a block (Sparse-dLLM: 2 full + 30 subset;
dKV-Cache, cache_reloading_step 8: steps 0, 1, 8, 16, 24 full, 27 subset; dual cache: 1 full + 31 subset). With
one token per step, tokens/s = 1 / step time; with Fast-dLLM's threshold rule every policy commits the same
tokens per step as the threshold sampler it runs with, so the ratios between columns carry over. FLOPs: the
analytic count of each call (2 × weights × rows + 4 × rows × keys × width per layer, + 2 × rows × width ×
vocabulary for the LM head), checked against XLA's cost analysis of the same call compiled for one layer with
dense attention (XLA counts the body of a loop once, so the scans over layers and query chunks of the timed
program would be undercounted; one layer with dense attention has no loop). The CPU model is printed; results
go to --json_out.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time

from absl import app, flags

from benchmarks.machine import cpu_model
from dlm_jax.policy import cost

_PRESET = flags.DEFINE_string("preset", "llada-8b", "The `dlm_jax.config` preset whose shape is measured.")
_LAYERS = flags.DEFINE_integer("layers", 2, "Transformer layers of that shape.")
_PROMPTS = flags.DEFINE_list("prompt_lengths", ["512", "1024"], "Prompt lengths.")
_GEN = flags.DEFINE_integer("gen_length", 256, "Generated positions.")
_BLOCK = flags.DEFINE_integer("block_length", 32, "Block length.")
_KEEP = flags.DEFINE_float("keep_ratio", 0.5, "Sparse-dLLM's keep ratio.")
_RELOAD = flags.DEFINE_integer("cache_reloading_step", 8, "dKV-Cache's refresh interval within a block.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Weights and activations dtype.")
_IMPL = flags.DEFINE_enum("attention_impl", "chunked", ["chunked", "dense", "fused"], "Attention path.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed runs per call after one warm-up; the median is reported.")
_JSON_OUT = flags.DEFINE_string("json_out", "policy_bench.json", "Where to write the results.")


def analytic_flops(config, rows: int, keys: int, head_rows: int) -> float:
  """Matmul FLOPs of a call: `rows` queries through every layer reading `keys` keys, the LM head on `head_rows`."""
  return cost.trunk_flops(config, rows, keys) + cost.head_flops(config, head_rows)


def main(argv: list[str]) -> None:
  del argv
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  from dlm_jax.config import preset  # pylint: disable=import-outside-toplevel
  from dlm_jax.model import KVCache, forward, init_params, lm_head  # pylint: disable=import-outside-toplevel
  from dlm_jax.model.compute_subset import ComputeSubset  # pylint: disable=import-outside-toplevel
  from dlm_jax.policy import sparse_dllm  # pylint: disable=import-outside-toplevel

  dtype = jnp.float32 if _DTYPE.value == "float32" else jnp.bfloat16
  config = dataclasses.replace(preset(_PRESET.value), n_layers=_LAYERS.value)
  print(f"CPU: {cpu_model()}; device: {jax.devices()[0].platform}; {config.n_layers} layers of {_PRESET.value}, "
        f"{_DTYPE.value}", flush=True)
  params = jax.tree.map(lambda a: a.astype(dtype), init_params(config, jax.random.key(0)))
  g, block = _GEN.value, _BLOCK.value
  results = {"cpu": cpu_model(), "device": jax.devices()[0].platform, "preset": _PRESET.value,
             "layers": config.n_layers,
             "dtype": _DTYPE.value, "gen_length": g, "block_length": block, "prompts": {}}
  impl = dict(config=config, attention_impl=_IMPL.value)

  def timed(fn, *args):
    compiled = jax.jit(fn).lower(*args).compile()
    jax.block_until_ready(compiled(*args))
    runs = []
    for _ in range(_REPEATS.value):
      start = time.perf_counter()
      jax.block_until_ready(compiled(*args))
      runs.append(time.perf_counter() - start)
    return statistics.median(runs)

  def make_calls(cfg, attention_impl, p, tokens, cache, prompt_length):
    """{call: (fn, args, (rows, keys, LM-head rows))} of the model `cfg` (module docstring)."""
    s = tokens.shape[1]
    impl = dict(config=cfg, attention_impl=attention_impl)
    start = prompt_length + 3 * block  # a block in the middle of the generation
    n_keep = sparse_dllm.keep_count(s, block, _KEEP.value)
    kept = jnp.broadcast_to(jnp.arange(n_keep, dtype=jnp.int32)[None, None], (cfg.n_layers, 1, n_keep))
    block_queries = (start + jnp.arange(block, dtype=jnp.int32))[None]
    generated = (prompt_length + jnp.arange(g, dtype=jnp.int32))[None]

    def dkv_subset(p, t, c):
      hidden = forward(p, t[:, prompt_length:], cache=c, return_hidden=True, subset=ComputeSubset(generated),
                       **impl).hidden
      return lm_head(p, hidden[:, 3 * block:4 * block], config=cfg)

    return {
        "exact": (lambda p, t: forward(p, t, logits_window=(start, start + block), **impl).logits, (p, tokens),
                  (s, s, block)),
        "full": (lambda p, t, c: forward(p, t, cache=c, logits_window=(start, start + block), **impl).logits,
                 (p, tokens, cache), (s, s, block)),
        "dkv_subset": (dkv_subset, (p, tokens, cache), (g, s, block)),
        "sparse_subset": (lambda p, t, c: forward(p, t[:, start:start + block], cache=c,
                                                  subset=ComputeSubset(block_queries, kept), **impl).logits,
                          (p, tokens, cache), (block, n_keep + block, block)),
        "dual_cache": (lambda p, t, c: forward(p, t[:, start:start + block], cache=c, cache_offset=start,
                                               **impl).logits, (p, tokens, cache), (block, s, block)),
    }

  one = dataclasses.replace(config, n_layers=1)
  one_params = jax.eval_shape(lambda: jax.tree.map(lambda a: a.astype(dtype), init_params(one, jax.random.key(0))))
  for prompt_length in (int(p) for p in _PROMPTS.value):
    s = prompt_length + g
    tokens = jax.random.randint(jax.random.key(1), (1, s), 0, config.vocab_size)
    cache = jax.tree.map(lambda a: a.astype(dtype), KVCache.zeros(config, 1, s))
    one_cache = jax.eval_shape(lambda: jax.tree.map(lambda a: a.astype(dtype), KVCache.zeros(one, 1, s)))
    check = make_calls(one, "dense", one_params, tokens, one_cache, prompt_length)
    measured = {}
    for name, (fn, args, (rows, keys, head_rows)) in make_calls(config, _IMPL.value, params, tokens, cache,
                                                                prompt_length).items():
      seconds = timed(fn, *args)
      one_fn, one_args, _ = check[name]
      xla = jax.jit(one_fn).lower(*one_args).compile().cost_analysis()["flops"]
      flops, analytic_one = analytic_flops(config, rows, keys, head_rows), analytic_flops(one, rows, keys, head_rows)
      measured[name] = {"ms": seconds * 1e3, "flops": flops, "xla_flops_1_layer": xla,
                        "analytic_flops_1_layer": analytic_one}
      print(f"  S={s} {name:14s} {seconds * 1e3:10.1f} ms  {flops / 1e9:9.1f} GFLOP (analytic)  one layer: XLA "
            f"{xla / 1e9:.2f} vs analytic {analytic_one / 1e9:.2f} GFLOP ({xla / analytic_one - 1:+.1%})", flush=True)

    def step(schedule):
      """Mean ms and FLOPs of a step over a block's `schedule` {call: count}."""
      n = sum(schedule.values())
      return {key: sum(measured[call][key] * count for call, count in schedule.items()) / n for key in ("ms", "flops")}

    reload_full = len({0, 1} | set(range(0, block, _RELOAD.value)))
    methods = {"exact": step({"exact": block}),
               "dual_cache (Fast-dLLM)": step({"full": 1, "dual_cache": block - 1}),
               "dkv_cache": step({"full": reload_full, "dkv_subset": block - reload_full}),
               "sparse_dllm": step({"full": 2, "sparse_subset": block - 2})}
    print(f"prompt {prompt_length} + {g}: per step (one token per step)")
    for name, cost in methods.items():
      print(f"  {name:24s} {cost['ms']:10.1f} ms/step  {cost['flops'] / 1e9:9.1f} GFLOP/step  "
            f"{1e3 / cost['ms']:7.3f} tokens/s  {methods['exact']['ms'] / cost['ms']:5.2f}x exact  "
            f"{methods['dual_cache (Fast-dLLM)']['ms'] / cost['ms']:5.2f}x dual cache", flush=True)
    results["prompts"][prompt_length] = {"calls": measured, "steps": methods}
  with open(_JSON_OUT.value + ".tmp", "w", encoding="utf-8") as f:
    json.dump(results, f, indent=1)
  os.replace(_JSON_OUT.value + ".tmp", _JSON_OUT.value)
  print(f"wrote {_JSON_OUT.value}")


if __name__ == "__main__":
  app.run(main)
