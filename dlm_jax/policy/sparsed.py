"""SparseD (ICLR 2026; INV-WZQ/SparseD): a block-sparse key mask per head, chosen once, reused to the end.

Rule, as read in the official code (`models/LLaDA/modeling_llada.py` `LLaDABlock.attention` and
`models/Dream/modeling_dream.py` `DreamAttention.forward`, both on `SparseD_param`; the block scoring
`create_attention_block_mask` of `SparseD_utils.py`; the step counter of `models/LLaDA/generate.py`):

* the step counter is global across semi-AR blocks (`now_step = i + num_block * steps_per_block`);
  E = int(total_steps x skip) + 1 (`warmup_end`); steps 0 .. E are dense attention (`is_full_step`);
* at step E, per layer, from that step's post-RoPE q and k (all S queries, all S keys): for each query
  block of `block_size` rows, softmax(q k^T x scale) over all keys, block-pooled as
  sum abs(p) / block_size^2 per (head, query block, key block) — a mean over the zero-padded block, so
  a partial last block is divided by the full block_size^2 (`block_pool`, `pooled_statistics`);
* per head and query block, keep the top int(n x select) + 1 key blocks of that pooled map, then clear
  every key block from the generation block g on (`generation_block`); a second pass takes the softmax
  over the keys from g x block_size on only (renormalised), pools it, keeps the top
  int(n_g x select) + 1 of those n_g key blocks and ORs them in (`keep_mask`). No sink or diagonal
  block is kept by rule;
* every step after E attends with that mask (FlexAttention in the official code); the mask is rebuilt at
  the next generation's step E. Only QK^T and PV of dropped blocks are skipped: every query, layer and
  FFN still runs.

Score scale (official quirk, `score_scale`): LLaDA divides by sqrt(n_heads), Dream by sqrt(head_dim).
What the forward must provide (per layer, at step E only): post-RoPE `q` [B, T, N, H] of all T = S
positions and `k` [B, S, K, H] (K divides N); `pooled_statistics` computes the probabilities one query
block at a time (never the whole [B, N, S, S] at once).
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, Literal

import jax
import jax.numpy as jnp

from dlm_jax.policy.positions import is_integer, is_number
from dlm_jax.sampling.selection import select_top_k

FAMILIES = ("llada", "dream")
"""Model families of the official scripts (`llada_generation.py`: LLaDA-1.5; `dream_generation.py`:
Dream-v0-Instruct-7B)."""

SHORT_TASKS = ("short_context", "gsm8k", "humaneval", "math", "mbpp")
"""Tasks given the README's short-prompt values (select 0.5, block_size 32): its `short_context` prompt;
the benchmark names are our reading (their prompts are short), not an official script."""

LONG_TASKS = ("4k", "8k", "16k", "32k", "64k")
"""The README's long prompts, given select 0.3, block_size 128."""


@dataclasses.dataclass(frozen=True)
class SparseDSettings:
  """SparseD's knobs (module docstring).

  skip: fraction of all steps run dense before the mask is chosen, in [0, 1); select: key-block keep
  ratio, in (0, 1]; block_size: query and key block length (>= 1); score_scale: "num_heads" (LLaDA's
  official 1/sqrt(n_heads)) or "head_dim" (Dream's, and standard attention's, 1/sqrt(head_dim));
  boundary_from: the length that places the generation block g — "gen_length" (LLaDA's
  `llada_generation.py` passes seq_len as `new_generation`) or "steps" (Dream's `_sample` overwrites
  `new_generation` with the step count; the two agree whenever steps == gen_length, the scripts'
  default).
  """

  NAME: ClassVar[str] = "sparsed"

  skip: float = 0.2
  select: float = 0.3
  block_size: int = 128
  score_scale: Literal["num_heads", "head_dim"] = "num_heads"
  boundary_from: Literal["gen_length", "steps"] = "gen_length"

  def __post_init__(self):
    self.check()

  def check(self) -> None:
    """Refuse knobs out of range, in one line naming the knob."""
    if not is_number(self.skip) or not 0.0 <= self.skip < 1.0:
      raise ValueError(f"sparsed skip must be a number in [0, 1), got {self.skip!r}.")
    if not is_number(self.select) or not 0.0 < self.select <= 1.0:
      raise ValueError(f"sparsed select must be a number in (0, 1], got {self.select!r}.")
    if not is_integer(self.block_size) or self.block_size < 1:
      raise ValueError(f"sparsed block_size must be an integer >= 1, got {self.block_size!r}.")
    if self.score_scale not in ("num_heads", "head_dim"):
      raise ValueError(f"sparsed score_scale must be 'num_heads' or 'head_dim', got {self.score_scale!r}.")
    if self.boundary_from not in ("gen_length", "steps"):
      raise ValueError(f"sparsed boundary_from must be 'gen_length' or 'steps', got {self.boundary_from!r}.")

  @classmethod
  def published(cls, family: str, task: str = "gsm8k") -> "SparseDSettings":
    """README values: skip 0.2 always; select 0.5 with block_size 32 for short prompts
    (`--prompt short_context`), select 0.3 with block_size 128 for the 4k..64k prompts (also the
    scripts' argparse defaults). family "llada" (1/sqrt(n_heads), boundary from gen_length) or "dream"
    (1/sqrt(head_dim), boundary from the step count); task in `SHORT_TASKS` or `LONG_TASKS`."""
    if family not in FAMILIES:
      raise ValueError(f"sparsed has official settings for families {FAMILIES}, got {family!r}.")
    if task in SHORT_TASKS:
      select, block_size = 0.5, 32
    elif task in LONG_TASKS:
      select, block_size = 0.3, 128
    else:
      raise ValueError(f"sparsed has published settings for tasks {SHORT_TASKS + LONG_TASKS}, got {task!r}.")
    if family == "llada":
      return cls(skip=0.2, select=select, block_size=block_size)
    return cls(skip=0.2, select=select, block_size=block_size, score_scale="head_dim", boundary_from="steps")


def warmup_end(total_steps: int, skip: float) -> int:
  """E = int(total_steps x skip) + 1 (Python float arithmetic, as the official code): the step that
  chooses the mask; steps 0 .. E are dense."""
  return int(total_steps * skip) + 1


def is_full_step(step: jax.Array, end: int) -> jax.Array:
  """Dense attention at global steps 0 .. E (traced int -> bool)."""
  return step <= end


def is_selection_step(step: jax.Array, end: int) -> jax.Array:
  """The mask is chosen from step E's q and k (traced int -> bool)."""
  return step == end


def uses_mask(step: jax.Array, end: int) -> jax.Array:
  """Steps after E attend through the mask (traced int -> bool)."""
  return step > end


def score_scale(settings: SparseDSettings, num_heads: int, head_dim: int) -> float:
  """The factor on q.k before the softmax of the statistic: 1/sqrt(num_heads) or 1/sqrt(head_dim)."""
  return 1.0 / math.sqrt(num_heads if settings.score_scale == "num_heads" else head_dim)


def boundary_length(settings: SparseDSettings, gen_length: int, total_steps: int) -> int:
  """The length `generation_block` measures from the end: gen_length or the step count, as
  `settings.boundary_from` says."""
  return gen_length if settings.boundary_from == "gen_length" else total_steps


def generation_block(seq_len: int, boundary_length: int, block_size: int) -> int:
  """g, the first key block of the generation region: the first query block index i with
  seq_len - i x block_size <= boundary_length, or the last block when none is (official rule; with a
  prompt that is not a multiple of block_size, the block straddling the boundary counts as prompt)."""
  n_blocks = -(-seq_len // block_size)
  for index in range(n_blocks):
    if seq_len - index * block_size <= boundary_length:
      return index
  return n_blocks - 1


def _scores(q: jax.Array, k: jax.Array, scale: float) -> jax.Array:
  """q.k^T x scale with KV heads repeated: q [B, T, N, H], k [B, S, K, H] -> [B, N, T, S] float32."""
  keys = jnp.repeat(k.astype(jnp.float32), q.shape[2] // k.shape[2], axis=2)
  return jnp.einsum("btnh,bsnh->bnts", q.astype(jnp.float32), keys) * scale


def _softmax_from(scores: jax.Array, key_start: int) -> jax.Array:
  """Softmax over the last axis restricted to keys >= key_start (the others get probability 0)."""
  return jax.nn.softmax(jnp.where(jnp.arange(scores.shape[-1]) >= key_start, scores, -jnp.inf), axis=-1)


def attention_probabilities(q: jax.Array, k: jax.Array, scale: float, key_start: int = 0) -> jax.Array:
  """softmax(q k^T x scale) over the keys from key_start on (earlier keys get probability 0).

  q: [B, T, N, H]; k: [B, S, K, H] (query head h reads key head h // (N / K)). Returns [B, N, T, S]
  float32.
  """
  return _softmax_from(_scores(q, k, scale), key_start)


def block_pool(probabilities: jax.Array, block_size: int) -> jax.Array:
  """Block-pooled abs(p): [B, N, T, S] -> [B, N, ceil(T / bs), ceil(S / bs)], each entry the sum over its
  block divided by bs^2 (the official mean over a zero-padded block)."""
  batch, heads, rows, cols = probabilities.shape
  n_q, n_k = -(-rows // block_size), -(-cols // block_size)
  padded = jnp.pad(jnp.abs(probabilities), ((0, 0), (0, 0), (0, n_q * block_size - rows),
                                            (0, n_k * block_size - cols)))
  blocks = padded.reshape(batch, heads, n_q, block_size, n_k, block_size)
  return jnp.sum(blocks, axis=(3, 5)) / float(block_size * block_size)


def pooled_statistics(q: jax.Array, k: jax.Array, settings: SparseDSettings, scale: float,
                      generation: int, row_weights: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """Both pooled maps of step E, one query block at a time: (over all keys, over the generation keys).

  q: [B, T, N, H]; k: [B, S, K, H]; scale: `score_scale(...)`; generation: g from `generation_block`;
  row_weights: [B, T] >= 0, each query row's probabilities multiplied by its weight (None: 1, the official).
  Returns two [B, N, nQb, nKb] float32 maps (nQb = ceil(T / bs), nKb = ceil(S / bs)); the second is zero
  in key blocks < g. Padded query rows of a partial last block contribute nothing, as in the official.
  """
  bs = settings.block_size
  batch, rows, heads, dim = q.shape
  n_q = -(-rows // bs)
  q_blocks = jnp.pad(q, ((0, 0), (0, n_q * bs - rows), (0, 0), (0, 0))).reshape(batch, n_q, bs, heads, dim)
  weights = jnp.ones((batch, rows), jnp.float32) if row_weights is None else row_weights.astype(jnp.float32)
  row_valid = jnp.moveaxis(jnp.pad(weights, ((0, 0), (0, n_q * bs - rows))).reshape(batch, n_q, bs), 1, 0)

  def one_block(inputs):
    q_block, valid = inputs
    keep = valid[:, None, :, None]
    scores = _scores(q_block, k, scale)
    full = keep * _softmax_from(scores, 0)
    tail = keep * _softmax_from(scores, generation * bs)
    return block_pool(full, bs)[:, :, 0], block_pool(tail, bs)[:, :, 0]

  pooled_all, pooled_generation = jax.lax.map(one_block, (jnp.moveaxis(q_blocks, 1, 0), row_valid))
  return jnp.moveaxis(pooled_all, 0, 2), jnp.moveaxis(pooled_generation, 0, 2)


def _keep_count(n_blocks: int, select: float) -> int:
  """int(n x select) + 1, at least 1, clamped to n (as one copy of the official helper does)."""
  return min(max(1, int(n_blocks * select) + 1), n_blocks)


def max_kept_blocks(n_blocks: int, generation: int, select: float) -> int:
  """m: the most key blocks `keep_mask` keeps for one head and query block (pass one keeps at most
  min(int(n x select) + 1, g) blocks before g, pass two int(n_g x select) + 1 from g on)."""
  return min(_keep_count(n_blocks, select), generation) + _keep_count(n_blocks - generation, select)


def _top_blocks(pooled: jax.Array, keep: int) -> jax.Array:
  """Top `keep` entries along the last axis as a bool mask, ties to the lower block."""
  flat = pooled.reshape(-1, pooled.shape[-1])
  return select_top_k(flat, keep).reshape(pooled.shape)


def keep_mask(pooled_all: jax.Array, pooled_generation: jax.Array, select: float, generation: int) -> jax.Array:
  """The block mask: [B, N, nQb, nKb] bool, True where a query block reads a key block.

  pooled_all, pooled_generation: from `pooled_statistics`; select: the keep ratio; generation: g. Pass
  one: top int(nKb x select) + 1 of pooled_all, key blocks >= g cleared. Pass two: top
  int(n_g x select) + 1 of pooled_generation's key blocks >= g (n_g = nKb - g), OR-ed in. Ties go to the
  lower block (the official unsorted torch.topk leaves them open).
  """
  n_k = pooled_all.shape[-1]
  block = jnp.arange(n_k)
  first = _top_blocks(pooled_all, _keep_count(n_k, select)) & (block < generation)
  n_generation = n_k - generation
  second = _top_blocks(pooled_generation[..., generation:], _keep_count(n_generation, select))
  return first | jnp.pad(second, ((0, 0),) * (second.ndim - 1) + ((generation, 0),))


def dense_mask(blocks: jax.Array, seq_len: int, block_size: int) -> jax.Array:
  """The block mask expanded to tokens: [B, N, nQb, nKb] -> [B, N, S, S] bool (query row, key column)."""
  expanded = jnp.repeat(jnp.repeat(blocks, block_size, axis=2), block_size, axis=3)
  return expanded[:, :, :seq_len, :seq_len]
