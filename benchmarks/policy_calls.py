"""The model calls a sampler step of each compute policy is made of, at one prompt length, as the policy benchmark
times them (`benchmarks.policy_bench`): each a pure function of (params, tokens, cache) and its analytic FLOPs.

Every call reads a whole sequence of S = prompt + G positions (G generated, in blocks of `block`) whose current
block is the fourth (`block_start`), and computes the LM head on the rows a sampler reads. Calls (rows × keys per
layer; LM-head rows):

  exact            all S through the trunk over S keys; the block (LLaDA's sampler);
  full             the same, writing the policy's KV cache (every policy's refresh call);
  dkv_subset       dKV-Cache: the G generated positions (its static budget) over all S cached keys; the block;
  dkv_subset/<2^k> dKV-Cache at its smaller buckets (`DKVCache.buckets`: G and its halves): the last G / 2^k
                   positions over all S cached keys; the LM head on their first `block` rows (the block; all of
                   them when fewer);
  sparse_subset    Sparse-dLLM at a block's steps >= 2: the block's queries, each layer over its
                   int((S − block) × keep_ratio) kept keys and the block; the block;
  dual_cache       Fast-dLLM's dual cache: the block's queries over all S cached keys; the block;
  sparsed_blocks   SparseD after its warm-up: all S positions, each head's query block of 128 over its kept key
                   blocks (the rule's static count m, `SparseD.kept_blocks`); the block;
  reuse_<case>     dLLM-Cache: every position through every layer; layer 0 recomputes all S (the official
                   quirk); each later layer recomputes the prompt (case prompt / both), the response (gen /
                   both), and otherwise `count` adaptive response positions after the response's value
                   projection; the block;
  elastic          Elastic-Cache: its static query budget n = L · track_num + 2 · window_length through the
                   layers below the refresh start, every position from it on, the drift test of the L · track_num
                   tracked tokens at every layer, the incoming attention it tracks tokens by; the block. One
                   program, timed at start L (no layer refreshed: `elastic_no_refresh`) and start 0 (every layer:
                   `elastic_full_refresh`);
  d2cache_S/<2^k>  d2Cache after step 0: ceil(S / 2^k) query rows (its static buckets: S and its halves,
                   `D2Cache.buckets`) over all S cached keys, with the statistic its rollout reads
                   ("attention_rows", the head-mean attention rows of the computed queries); the block.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from benchmarks import policy_schedules
from dlm_jax.config import ModelConfig
from dlm_jax.instrument.stats import StatsSpec
from dlm_jax.model import KVCache, forward, lm_head
from dlm_jax.model.block_sparse_attention import KeyBlocks
from dlm_jax.model.compute_subset import ComputeSubset
from dlm_jax.model.layer_refresh import LayerRefresh
from dlm_jax.model.reuse_layers import LayerReuse, ReuseCache
from dlm_jax.policy import cost, sparse_dllm
from dlm_jax.policy.base import RunLayout
from dlm_jax.policy.d2cache_policy import D2Cache
from dlm_jax.policy.dllm_cache_policy import DLLMCache
from dlm_jax.policy.elastic_cache_policy import ElasticCache
from dlm_jax.policy.policies import DKVCache
from dlm_jax.policy.sparsed_policy import SparseD
from dlm_jax.model.forward_inputs import CallInstruments, Compute, Readout

REUSE_CASES = {"reuse_none": (False, False), "reuse_gen": (False, True), "reuse_prompt": (True, False),
               "reuse_both": (True, True)}
"""dLLM-Cache's calls by (prompt recomputed, response recomputed) at the layers after the first."""


@dataclasses.dataclass(frozen=True)
class Methods:
  """The policies' settings the calls are built for: sparse_dllm's keep ratio, SparseD, dLLM-Cache,
  Elastic-Cache, d2Cache and dKV-Cache as policies (their published defaults unless the benchmark's flags say
  otherwise)."""

  keep_ratio: float
  sparsed: SparseD
  dllm_cache: DLLMCache
  elastic_cache: ElasticCache
  d2cache: D2Cache
  dkv_cache: DKVCache


@dataclasses.dataclass(frozen=True)
class Call:
  """One call: fn(*args) -> logits, or (logits, statistics) for a policy that reads statistics at every call
  (Elastic-Cache, d2Cache: returned, so that XLA keeps their work); flops: its analytic FLOPs (trunk + LM head)."""

  fn: Callable[..., jax.Array]
  args: tuple
  flops: float


def layout(prompt_length: int, gen_length: int, block: int) -> RunLayout:
  """The run a policy is bound to: one token per step (steps = gen_length)."""
  return RunLayout(seq_len=prompt_length + gen_length, gen_start=prompt_length, block_length=block,
                   steps_per_block=block)


def bound(methods: Methods, run: RunLayout) -> Methods:
  """The methods' policies bound to `run`."""
  return dataclasses.replace(methods, sparsed=methods.sparsed.bind(run), dllm_cache=methods.dllm_cache.bind(run),
                             elastic_cache=methods.elastic_cache.bind(run), d2cache=methods.d2cache.bind(run),
                             dkv_cache=methods.dkv_cache.bind(run))


def reuse_flops(config: ModelConfig, prompt_length: int, seq_len: int, count: int, case: tuple[bool, bool]) -> float:
  """Trunk FLOPs of a dLLM-Cache call (module docstring; layer 0 recomputes everything)."""
  prompt, gen = case
  g = seq_len - prompt_length
  rows = prompt * prompt_length + (g if gen else count)
  later = cost.reuse_layer_flops(config, rows, seq_len, value_rows=0 if gen or count == 0 else g)
  return cost.reuse_layer_flops(config, seq_len, seq_len) + (config.n_layers - 1) * later


def make_calls(config: ModelConfig, attention_impl: str, params: Any, tokens: jax.Array, prompt_length: int,
               block: int, methods: Methods, dtype: Any) -> dict[str, Call]:
  """{call name: Call} of the model `config` on tokens [1, S] (module docstring); params may be abstract
  (`jax.ShapeDtypeStruct` leaves) to lower a call without weights."""
  b, s = tokens.shape
  g = s - prompt_length
  impl = dict(config=config)
  path = Compute(attention_impl=attention_impl)
  start = prompt_length + 3 * block  # a block in the middle of the generation
  window = (start, start + block)
  methods = bound(methods, layout(prompt_length, g, block))
  abstract = lambda fn: jax.eval_shape(lambda: jax.tree.map(lambda a: a.astype(dtype), fn()))  # noqa: E731
  concrete = lambda fn: jax.tree.map(lambda a: a.astype(dtype), fn())  # noqa: E731
  make = abstract if isinstance(jax.tree.leaves(params)[0], jax.ShapeDtypeStruct) else concrete
  cache = make(lambda: KVCache.zeros(config, b, s))
  head = lambda rows: cost.head_flops(config, rows)  # noqa: E731
  calls = {}

  calls["exact"] = Call(lambda p, t: forward(p, t, readout=Readout(window=window), compute=path, **impl).logits,
                        (params, tokens),
                        cost.trunk_flops(config, s, s) + head(block))
  calls["full"] = Call(lambda p, t, c: forward(p, t, compute=path.replace(cache=c), readout=Readout(window=window),
                                               **impl).logits,
                       (params, tokens, cache), cost.trunk_flops(config, s, s) + head(block))

  def dkv_subset(p, t, c, rows):
    queries = (s - rows + jnp.arange(rows, dtype=jnp.int32))[None]
    hidden = forward(p, t[:, s - rows:], compute=path.replace(cache=c, subset=ComputeSubset(queries)),
                     readout=Readout(hidden=True), **impl).hidden
    first = 3 * block if rows == g else 0  # the block: the fourth at the whole budget, else the first computed
    return lm_head(p, hidden[:, first:first + block], config=config)

  buckets = methods.dkv_cache.buckets
  for rows in buckets:
    calls[policy_schedules.dkv_call(buckets, rows)] = Call(functools.partial(dkv_subset, rows=rows),
                                                           (params, tokens, cache),
                                                           cost.trunk_flops(config, rows, s) + head(min(rows, block)))

  n_keep = sparse_dllm.keep_count(s, block, methods.keep_ratio)
  kept = jnp.broadcast_to(jnp.arange(n_keep, dtype=jnp.int32)[None, None], (config.n_layers, b, n_keep))
  block_queries = (start + jnp.arange(block, dtype=jnp.int32))[None]
  calls["sparse_subset"] = Call(
      lambda p, t, c: forward(p, t[:, start:start + block],
                              compute=path.replace(cache=c, subset=ComputeSubset(block_queries, kept)), **impl).logits,
      (params, tokens, cache), cost.trunk_flops(config, block, n_keep + block) + head(block))
  calls["dual_cache"] = Call(
      lambda p, t, c: forward(p, t[:, start:start + block], compute=path.replace(cache=c, cache_offset=start),
                              **impl).logits,
      (params, tokens, cache), cost.trunk_flops(config, block, s) + head(block))

  sparsed = methods.sparsed
  m, n_blocks = sparsed.kept_blocks, sparsed.n_blocks
  index = jnp.broadcast_to(jnp.arange(m, dtype=jnp.int32) % n_blocks, (config.n_layers, b, config.n_heads, n_blocks, m))
  key_blocks = KeyBlocks(index, sparsed.block_size)
  calls["sparsed_blocks"] = Call(
      lambda p, t, c: forward(p, t, compute=path.replace(cache=c, subset=ComputeSubset(None, key_blocks=key_blocks)),
                              readout=Readout(window=window), **impl).logits,
      (params, tokens, cache), cost.block_sparse_flops(config, s, sparsed.block_size, m) + head(block))

  reuse = make(lambda: ReuseCache.zeros(config, b, s))
  count = methods.dllm_cache.refresh_count(g)
  everything = jnp.arange(s, dtype=jnp.int32)[None]
  for name, (prompt, gen) in REUSE_CASES.items():
    def reuse_call(p, t, c, attn, ffn, prompt=prompt, gen=gen):
      layer_reuse = LayerReuse(attn=attn, ffn=ffn, prompt_length=prompt_length, count=count, refresh_prompt=prompt,
                               refresh_gen=gen, first_layer_full=methods.dllm_cache.refresh_layer0)
      return forward(p, t, compute=path.replace(cache=c, subset=ComputeSubset(everything, reuse=layer_reuse)),
                     readout=Readout(window=window), **impl).logits

    calls[name] = Call(reuse_call, (params, tokens, reuse.kv, reuse.attn, reuse.ffn),
                       reuse_flops(config, prompt_length, s, count, (prompt, gen)) + head(block))

  elastic = methods.elastic_cache
  n = elastic.settings.query_budget(config.n_layers, s)
  queries = (s - n + jnp.arange(n, dtype=jnp.int32))[None]
  tracked = jnp.full((b, config.n_layers * elastic.track_num), s, jnp.int32)  # none: no drift can move the start
  hidden = make(lambda: jnp.zeros((config.n_layers, b, s, config.d_model), jnp.float32))
  positions = jnp.arange(s, dtype=jnp.int32)[None]
  incoming = elastic.required_stats(config)  # the incoming attention its tracking reads, every call

  def elastic_call(p, t, c, h, first):
    refresh = LayerRefresh(hidden=h, tracked=tracked, start=first, gamma=float(elastic.gamma), tokens=t,
                           positions=positions)
    out = forward(p, t[:, s - n:], compute=path.replace(cache=c, subset=ComputeSubset(queries, None, refresh)),
                  instruments=CallInstruments(stats_spec=incoming, query_weights=jnp.ones((b, 1, n), jnp.float32)),
                  readout=Readout(hidden=True), **impl)
    return _block_logits(p, out, config, block), out.stats

  tracked_count = config.n_layers * elastic.track_num
  for name, first in (("elastic_no_refresh", config.n_layers), ("elastic_full_refresh", 0)):
    calls[name] = Call(elastic_call, (params, tokens, cache, hidden, jnp.full((b,), first, jnp.int32)),
                       cost.layer_refresh_flops(config, n, s, tracked_count, first) + head(min(n, block)))

  rollout = StatsSpec(extra=("attention_rows",))

  def d2cache_call(p, t, c, subset, rows):
    out = forward(p, t[:, s - rows:], compute=path.replace(cache=c, subset=ComputeSubset(subset)),
                  instruments=CallInstruments(stats_spec=rollout), readout=Readout(hidden=True), **impl)
    return _block_logits(p, out, config, block), out.stats

  buckets = methods.d2cache.buckets
  for k, rows in enumerate(reversed(buckets)):
    subset = (s - rows + jnp.arange(rows, dtype=jnp.int32))[None]
    calls[f"d2cache_S/{2 ** k}"] = Call(
        functools.partial(d2cache_call, subset=subset, rows=rows), (params, tokens, cache),
        cost.trunk_flops(config, rows, s) + head(min(rows, block)))
  return calls


def _block_logits(params: Any, output, config: ModelConfig, block: int) -> jax.Array:
  """The LM head on the last `block` computed rows of a subset call's hidden states (the sampler reads its block
  only: `dlm_jax.sampling.policy_call` runs the head on the readout window's rows)."""
  return lm_head(params, output.hidden[:, -block:], config=config)


def check_layers(name: str) -> int:
  """The layers of the program whose XLA cost analysis checks call `name`'s analytic count: 1 (XLA counts a
  loop's body once, so a scan over layers is counted whole only at one layer), 2 for dLLM-Cache's calls (layer 0
  always recomputes everything; the layers after it run unrolled, one run per plan)."""
  return 2 if name.startswith("reuse_") else 1
