"""Each method's sampler step as a mix of the benchmark's calls (`benchmarks.policy_calls`) under exact decoding (one
token per step, steps = G), at its settings: {call: share of the steps}, shares summing to 1.

Fixed schedules are counted at the benchmark's layout (G generated positions in blocks of `block`):

  exact                 every step a full call;
  dual cache            per block, 1 `full` (the block-start refresh) and block − 1 `dual_cache`;
  dkv_cache             per block, `full` at steps 0, 1 and every multiple of cache_reloading_step, else its cached
                        call at the smallest of its buckets (`DKVCache.buckets`: G and its halves) holding the
                        positions masked in the previous call's input: at block k's step i, G − block·k − i + 1
                        (the block's masks and every later block's; `dkv_call`);
  sparse_dllm           per block, `full` at steps 0 and 1, else sparse_subset;
  sparse_dllm_dual_cache  Sparse-dLLM with the dual cache (our composition): per block, 1 `full` (the refresh), 1
                        `dual_cache` (step 1, which scores the keys), else sparse_subset;
  sparsed               over the G steps, `full` through step E = int(G × skip) + 1, sparsed_blocks after;
  dllm_cache            over the G steps (its counter runs across blocks), step n is reuse_<case> with the prompt
                        recomputed when n % prompt_interval_steps == 0 and the response when
                        n % gen_interval_steps == 0 (layer 0 always).

Elastic-Cache's layer refresh and d2Cache's query count follow the model's attention, so their mixes are
measured on the embedded tiny-dlm (`benchmarks.policy_call_mix`, 32 steps a run) and rescaled to G steps
(`measured`): the run's first call (a full call) once, the tiny runs' later calls' mix for the other G − 1.
"""

from __future__ import annotations

import collections

from dlm_jax.policy import sparsed as sparsed_rule


def share(counts: dict[str, float]) -> dict[str, float]:
  """counts normalised to shares (zero counts dropped)."""
  total = sum(counts.values())
  return {call: count / total for call, count in counts.items() if count}


def dkv_call(buckets: tuple[int, ...], count: int) -> str:
  """The benchmark's call (`benchmarks.policy_calls`) dKV-Cache's cached call runs as when `count` positions are
  to be computed: `dkv_subset` at its budget (the last of its ascending buckets), `dkv_subset/<2^k>` at the k-th
  halving, the smallest bucket holding count."""
  rows = min(b for b in buckets if b >= count)
  return "dkv_subset" if rows == buckets[-1] else f"dkv_subset/{2 ** (len(buckets) - 1 - buckets.index(rows))}"


def dkv_by_block(mix: dict[str, float], gen_length: int, block: int, buckets: tuple[int, ...]) -> dict[str, float]:
  """A dKV-Cache mix measured on one block of `block` positions (tiny-dlm: "full" and "dkv_subset" shares, the
  latter any cached call) put on the benchmark's G / block blocks: the cached share split evenly over the blocks,
  block k's at the bucket holding G − block·k (its cached calls' largest count: the block's masks and every later
  block's; exact when every bucket is a multiple of the block, as G and its halves down to the block are)."""
  blocks = gen_length // block
  out = {"full": mix.get("full", 0.0)}
  cached = sum(weight for call, weight in mix.items() if call != "full")
  for k in range(blocks):
    call = dkv_call(buckets, gen_length - block * k)
    out[call] = out.get(call, 0.0) + cached / blocks
  return share(out)


def exact_decoding(gen_length: int, block: int, reload_step: int, sparsed, dllm_cache,
                   dkv_buckets: tuple[int, ...]) -> dict[str, dict[str, float]]:
  """{method: {call: share}} of the fixed schedules (module docstring); sparsed and dllm_cache: the policies;
  dkv_buckets: dKV-Cache's buckets (`DKVCache.buckets` at the benchmark's layout)."""
  dkv = collections.Counter()
  for k in range(gen_length // block):
    for i in range(block):
      full = i <= 1 or i % reload_step == 0
      dkv["full" if full else dkv_call(dkv_buckets, gen_length - block * k - i + 1)] += 1
  end = sparsed_rule.warmup_end(gen_length, sparsed.skip)
  reuse = collections.Counter()
  for n in range(gen_length):
    prompt, gen = n % dllm_cache.prompt_interval_steps == 0, n % dllm_cache.gen_interval_steps == 0
    reuse[f"reuse_{'both' if prompt and gen else 'prompt' if prompt else 'gen' if gen else 'none'}"] += 1
  return {"exact": {"exact": 1.0},
          "dual_cache": share({"full": 1, "dual_cache": block - 1}),
          "dkv_cache": share(dict(dkv)),
          "sparse_dllm": share({"full": 2, "sparse_subset": block - 2}),
          "sparse_dllm_dual_cache": share({"full": 1, "dual_cache": 1, "sparse_subset": block - 2}),
          "sparsed": share({"full": min(end + 1, gen_length), "sparsed_blocks": max(gen_length - end - 1, 0)}),
          "dllm_cache": share(dict(reuse))}


def measured(first: str, later: dict[str, float], gen_length: int) -> dict[str, float]:
  """A measured mix over G steps: call `first` at step 0, the mix `later` at the G − 1 others."""
  mix = {call: weight * (gen_length - 1) / gen_length for call, weight in later.items()}
  mix[first] = mix.get(first, 0.0) + 1 / gen_length
  return mix


def mean(mix: dict[str, float], calls: dict[str, dict], key: str) -> float:
  """The mix's mean of calls[call][key] (ms or flops)."""
  return sum(weight * calls[call][key] for call, weight in mix.items())
