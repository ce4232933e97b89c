"""What the block-by-block samplers share: the block layout of their options and their driver phases.

`BlockLayout` is mixed into options dataclasses with `gen_length`, `block_length` (None = one block) and
`steps`; `phases` and `init_cache` are the Fast-dLLM modes' loop structure and KV cache
(`llada_blockwise`, `dream_blockwise`).
"""

from __future__ import annotations

from dlm_jax.model import KVCache
from dlm_jax.sampling import driver


class BlockLayout:
  """Block properties of a sampler's options (needs `gen_length`, `block_length`, `steps`)."""

  @property
  def block(self) -> int:
    """B, positions per block (gen_length when block_length is None)."""
    return self.gen_length if self.block_length is None else self.block_length

  @property
  def num_blocks(self) -> int:
    return self.gen_length // self.block

  @property
  def steps_per_block(self) -> int:
    return self.steps // self.num_blocks


def phases(cache: str, num_blocks: int, bound: int) -> tuple[driver.Phase, ...]:
  """The prefix cache: one phase per block (its query count S − s changes with the block), an opening (the
  block's first call), then up to bound − 1 steps. No cache and the dual cache: one phase over all blocks
  with the block index in the carry (fixed shapes; compiled once whatever the number of blocks)."""
  if cache == "prefix":
    return tuple(driver.Phase(arg=k, steps=bound - 1, opening=True) for k in range(num_blocks))
  return (driver.Phase(steps=num_blocks * bound),)


def policy_owns_cache(run) -> bool:
  """A compute policy runs (`run.caller`'s plan): it keeps the KV cache and emulates the options' Fast-dLLM cache
  in its decisions (`CACHE_POLICIES`), so every call hands the model the whole sequence and the family keeps no
  cache of its own."""
  return run.caller is not None and run.caller.plan.policy.enabled


def init_cache(run, params, batch: int) -> KVCache | None:
  """The run's `KVCache` ([L, B, S, K, H], the parameters' dtype), or None when the options have no cache or a
  compute policy keeps it (`policy_owns_cache`)."""
  if run.family.options.cache == "none" or policy_owns_cache(run):
    return None
  return KVCache.zeros(run.config, batch, run.total_length, params["embed"]["embedding"].dtype)


CACHE_POLICIES = ("sparse_dllm",)
"""The compute policies that compose with the prefix and dual caches: a key subset of the cached keys, the cache's
own query window (BUILD.md, "Sparse-dLLM with the Fast-dLLM caches")."""


def check_policy_cache(cache: str, name: str) -> None:
  """Refuses (one line) compute policy `name` with the prefix or dual cache unless it is one of `CACHE_POLICIES`:
  the others keep their own KV cache and choose each call's queries (d2cache, dkv_cache, dllm_cache,
  elastic_cache) or mask every query block over all S keys (sparsed), while those caches' calls compute a fixed
  query window over the cache (BUILD.md, "Compute policies with parallel decoding")."""
  if cache != "none" and name not in CACHE_POLICIES:
    raise ValueError(f"policy {name!r} does not compose with cache={cache!r}: it chooses what each call computes "
                     "over all S positions, which the cache's fixed query window does not leave it; use cache='none' "
                     f"with it (with a cache: {', '.join(CACHE_POLICIES)}).")
