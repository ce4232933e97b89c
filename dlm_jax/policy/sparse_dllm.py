"""Sparse-dLLM (arXiv 2508.02558; OpenMOSS/Sparse-dLLM): per-layer key eviction chosen once per block.

Rule, as read in the official code (`CustomCache.filter_cache`; the attention branch on `cache_state` in
`opencompass/models/sparse_dllm/dream/modeling_dream.py`; the per-step `cache_state = 2 if i > 1 else i`
of the block loop):

* steps 0 and 1 of every semi-AR block are full forwards over the whole sequence (`is_full_step`);
* at step 1, per layer, after RoPE: the block's queries are averaged into one query per head, dotted with
  every key *outside* the block (GQA keys repeated head-interleaved), no 1/sqrt(d), no softmax, then the
  scores are averaged over heads: one score per outside key (`block_query_key_scores`);
* the outside scores, laid end to end (prefix then suffix, the block cut out), are max-pooled (kernel k,
  stride 1, padding k // 2 with -inf, so the last prefix key and the first suffix key are neighbours),
  and the top floor(keep_ratio x #outside) keys are kept per layer, the same set for every head
  (`keep_positions`); prompt, sinks and suffix compete in one pool, nothing outside the block is kept
  by rule;
* steps >= 2 of the block feed only the block's tokens; their attention reads the kept keys plus the
  block's fresh keys (`attended_keys`); the kept K/V are frozen until the block ends.

Block diffusion (LLaDA2.x / SDAR; ours, no official code): the block's queries see only the cached prefix
[0, s) outside the block, so the candidates are those s keys and int(s x keep_ratio) are kept
(`keep_prefix_positions`); the schedule above is kept (docs/guides/compute_policies.md, "sparse_dllm").

What the forward must provide (per layer, at the block's step 1): `q_block` [B, L, N, H], the post-RoPE
queries of the block's L positions; `k` [B, S, K, H], the post-RoPE keys of all S positions (K divides N).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

import jax
import jax.numpy as jnp

from dlm_jax.policy.positions import ascending_positions, is_integer, is_number
from dlm_jax.policy.torch_topk import torch_cpu_top_k, torch_cpu_top_k_prefix

FAMILIES = ("llada", "dream")
"""Model families the official evaluation scripts run (LLaDA-8B-Instruct, LLaDA-1.5, Dream-v0 Base and
Instruct)."""


@dataclasses.dataclass(frozen=True)
class SparseDLLMSettings:
  """Sparse-dLLM's knobs (module docstring).

  keep_ratio: fraction of the keys outside the block kept per layer, in (0, 1]; kernel_size: the
  max-pool kernel, odd >= 1 (1 = no pooling, as the official wrapper's `kernel_size=None`);
  pool_across_block_gap: True (the official code) pools the outside scores laid end to end, so the keys
  on either side of the block are pooling neighbours; False pools in sequence coordinates, the block's
  positions counting as -inf; tie_break: which of the keys tied at the cut are kept — "torch_cpu" (the
  set `torch.topk` returns on CPU, `dlm_jax.policy.torch_topk`; ties at the cut are routine after the
  max-pool, so parity with the official code on CPU needs it) or "lowest_position" (one `lax.top_k`,
  cheaper).
  """

  NAME: ClassVar[str] = "sparse_dllm"

  keep_ratio: float = 0.5
  kernel_size: int = 3
  pool_across_block_gap: bool = True
  tie_break: Literal["torch_cpu", "lowest_position"] = "torch_cpu"

  def __post_init__(self):
    self.check()

  def check(self) -> None:
    """Refuse knobs out of range, in one line naming the knob."""
    if not is_number(self.keep_ratio) or not 0.0 < self.keep_ratio <= 1.0:
      raise ValueError(f"sparse_dllm keep_ratio must be a number in (0, 1], got {self.keep_ratio!r}.")
    if not is_integer(self.kernel_size) or self.kernel_size < 1 or self.kernel_size % 2 == 0:
      raise ValueError(f"sparse_dllm kernel_size must be an odd integer >= 1 (1: no pooling), "
                       f"got {self.kernel_size!r}.")
    if not isinstance(self.pool_across_block_gap, bool):
      raise ValueError(f"sparse_dllm pool_across_block_gap must be a bool, got {self.pool_across_block_gap!r}.")
    if self.tie_break not in ("torch_cpu", "lowest_position"):
      raise ValueError(f"sparse_dllm tie_break must be 'torch_cpu' or 'lowest_position', got {self.tie_break!r}.")

  @classmethod
  def published(cls, family: str, task: str = "gsm8k") -> "SparseDLLMSettings":
    """The official scripts' values: kernel 3, keep_ratio 0.5 for every family and task
    (`myeval/eval_performance/eval_sparse_dllm_{llada_chat,llada_1.5,dream_chat,dream_base}.py`,
    `myeval/eval_speed/{llada,dream}_sparse_dllm.py`), with block 32, steps 256 and 256 generated tokens
    on the sampler side (512 / 512 for HumanEval and LongBench, as the scripts' comment says). The values
    do not vary by task, so any task name is accepted. family: "llada" or "dream"."""
    if family not in FAMILIES:
      raise ValueError(f"sparse_dllm has official settings for families {FAMILIES}, got {family!r}.")
    del task
    return cls(keep_ratio=0.5, kernel_size=3)


def keep_count(seq_len: int, block_length: int, keep_ratio: float) -> int:
  """The static number of kept keys: int(#outside x keep_ratio) in Python float arithmetic, as the
  official `int(importance.size(-1) * keep_ratio)`, #outside = seq_len - block_length."""
  return int((seq_len - block_length) * keep_ratio)


def is_full_step(step_in_block: jax.Array) -> jax.Array:
  """Steps 0 and 1 of a block are full forwards (traced int, any shape -> bool of that shape)."""
  return step_in_block <= 1


def is_selection_step(step_in_block: jax.Array) -> jax.Array:
  """Step 1 of a block scores the keys and chooses the kept set (traced int -> bool)."""
  return step_in_block == 1


def block_query_key_scores(q_block: jax.Array, k: jax.Array) -> jax.Array:
  """One score per key: the head mean of (block-mean query) . key, raw (no scale, no softmax).

  q_block: [B, L, N, H] post-RoPE queries of the block's positions; k: [B, S, K, H] post-RoPE keys of all
  positions, K dividing N (query head h reads key head h // (N / K)). Returns [B, S] float32 in sequence
  coordinates; the block's own positions get scores too and are excluded by `keep_positions`.
  """
  q_mean = jnp.mean(q_block.astype(jnp.float32), axis=1)
  groups = q_block.shape[2] // k.shape[2]
  q_grouped = q_mean.reshape(q_mean.shape[0], k.shape[2], groups, q_mean.shape[-1])
  per_head = jnp.einsum("bkgh,bskh->bkgs", q_grouped, k.astype(jnp.float32))
  return jnp.mean(per_head.reshape(per_head.shape[0], -1, per_head.shape[-1]), axis=1)


def _max_pool(values: jax.Array, kernel_size: int) -> jax.Array:
  """Stride-1 max-pool along the last axis with kernel_size // 2 of -inf padding on each side (same
  length for odd kernels): [B, W] -> [B, W]."""
  half = kernel_size // 2
  padded = jnp.pad(values, ((0, 0), (half, half)), constant_values=-jnp.inf)
  width = values.shape[-1]
  return jnp.max(jnp.stack([padded[:, j:j + width] for j in range(kernel_size)]), axis=0)


def _top(scores: jax.Array, count: int, tie_break: str) -> jax.Array:
  """The chosen entries of each row as ascending indices: scores [B, W] -> [B, count] int32."""
  if tie_break == "torch_cpu":
    return ascending_positions(torch_cpu_top_k(scores, count), count)[0]
  return jnp.sort(jax.lax.top_k(scores, count)[1], axis=-1).astype(jnp.int32)


def keep_positions(scores: jax.Array, block_start: jax.Array, block_length: int,
                   settings: SparseDLLMSettings) -> jax.Array:
  """The kept keys of one layer: [B, n_keep] int32 sequence positions, ascending.

  scores: [B, S] from `block_query_key_scores`; block_start: the block's first position (traced int,
  scalar or [B]); block_length: L (static). n_keep = `keep_count(S, L, keep_ratio)`, the same for every
  row (no validity mask needed). Keys tied at the cut are chosen as `settings.tie_break` says.
  """
  batch, seq_len = scores.shape
  n_outside = seq_len - block_length
  n_keep = keep_count(seq_len, block_length, settings.keep_ratio)
  start = jnp.broadcast_to(jnp.asarray(block_start, jnp.int32).reshape(-1, 1), (batch, 1))
  scores = scores.astype(jnp.float32)
  if settings.pool_across_block_gap:
    compact = jnp.arange(n_outside, dtype=jnp.int32)[None, :]
    outside_position = compact + block_length * (compact >= start)
    pooled = _max_pool(jnp.take_along_axis(scores, outside_position, axis=1), settings.kernel_size)
    return jnp.take_along_axis(outside_position, _top(pooled, n_keep, settings.tie_break), axis=1)
  position = jnp.arange(seq_len, dtype=jnp.int32)[None, :]
  in_block = (position >= start) & (position < start + block_length)
  pooled = _max_pool(jnp.where(in_block, -jnp.inf, scores), settings.kernel_size)
  return _top(jnp.where(in_block, -jnp.inf, pooled), n_keep, settings.tie_break)


def keep_prefix_positions(scores: jax.Array, block_start: jax.Array, block_length: int,
                          settings: SparseDLLMSettings) -> jax.Array:
  """The kept keys of one layer under block diffusion's exact cache (ours; no official code): the keys a block
  sees outside itself are the cached prefix [0, s), s = block_start, and int(s x keep_ratio) of them are kept.

  scores: [B, S] from `block_query_key_scores`, S a multiple of L; block_start: traced scalar, a multiple of
  block_length L. The prefix scores are max-pooled as `keep_positions` pools them (kernel k, -inf padding: the
  block and what follows it are no pooling neighbours, there being no suffix to lay end to end) and the top
  count taken with `settings.tie_break` ("torch_cpu": the set `torch.topk` returns on the s prefix scores).
  Returns [B, n_max] int32 ascending, n_max = `keep_count(S, L, keep_ratio)` (the last block's count), the
  entries after the block's own count equal to S.
  """
  batch, seq_len = scores.shape
  width, n_max = seq_len - block_length, keep_count(seq_len, block_length, settings.keep_ratio)
  start = jnp.asarray(block_start, jnp.int32)
  counts = jnp.asarray([keep_count(j * block_length + block_length, block_length, settings.keep_ratio)
                        for j in range(seq_len // block_length)], jnp.int32)
  count = counts[start // block_length]
  position = jnp.arange(width, dtype=jnp.int32)[None, :]
  visible = position < start
  pooled = _max_pool(jnp.where(visible, scores[:, :width].astype(jnp.float32), -jnp.inf), settings.kernel_size)
  pooled = jnp.where(visible, pooled, -jnp.inf)
  if settings.tie_break == "torch_cpu":
    index, valid = ascending_positions(torch_cpu_top_k_prefix(pooled, count, jnp.maximum(start, 1)), n_max)
    return jnp.where(valid, index, seq_len)
  ranked = jax.lax.top_k(pooled, n_max)[1].astype(jnp.int32)
  return jnp.sort(jnp.where(jnp.arange(n_max)[None, :] < count, ranked, seq_len), axis=-1)


def attended_keys(kept: jax.Array, block_start: jax.Array, block_length: int) -> jax.Array:
  """The keys a query of the block reads at steps >= 2: the kept keys then the block's positions,
  [B, n_keep + L] int32 (kept ascending, then block_start .. block_start + L - 1).

  kept: [B, n_keep] from `keep_positions`; block_start: traced int, scalar or [B].
  """
  start = jnp.broadcast_to(jnp.asarray(block_start, jnp.int32).reshape(-1, 1), (kept.shape[0], 1))
  return jnp.concatenate([kept, start + jnp.arange(block_length, dtype=jnp.int32)[None, :]], axis=1)
