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


def init_cache(run, params, batch: int) -> KVCache | None:
  """The run's `KVCache` ([L, B, S, K, H], the parameters' dtype), or None when the options have no cache."""
  if run.family.options.cache == "none":
    return None
  return KVCache.zeros(run.config, batch, run.total_length, params["embed"]["embedding"].dtype)


def check_policy_cache(cache: str, name: str) -> None:
  """Refuses (one line) compute policy `name` with the prefix or dual cache: the policy keeps its own KV cache of
  the S positions and decides which queries each call computes, while those caches' calls compute a fixed query
  window over the family's cache (BUILD.md, "Compute policies with parallel decoding")."""
  if cache != "none":
    raise ValueError(f"policy {name!r} does not compose with cache={cache!r}: the policy keeps its own KV cache "
                     "and chooses each call's queries itself; use cache='none' with it (sparse_dllm's calls after a "
                     "block's second already compute only the block's queries over cached keys, as the dual cache "
                     "does).")
