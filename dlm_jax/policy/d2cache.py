"""d2Cache (dual adaptive cache, ICLR 2026): which positions step t+1 recomputes, from step t's attention
rollout and a certainty score of the masked positions. Rules as read in Kamichanw/d2Cache ("Research dLLM"):
`src/cache/d2cache.py` class `d2Cache` (`accumulate_attn_rollout`, `on_step_end`, `top_up_mask`,
`model_forward`), `src/utils/common.py` (`certainty_density`, `nucleus_select`, `top_up_mask_`), defaults in
`configs/gen_args.py` and `configs/cache/d2cache.yaml`. Facts only; no code of theirs is copied.

What the official code does (each point read in the file and function named):

* Step 0 runs every position; later steps run only the selected positions through every layer (their K/V
  rows overwrite the cache, attention reads all S cached keys, the other positions' logits are zero-filled).
  No periodic full refresh (`model_forward`, `attention`).
* Rollout (`accumulate_attn_rollout`): per layer, the head-mean softmax attention rows of the computed queries
  are written into an S×S identity (rows of uncomputed positions stay identity rows), the identity is added,
  every row divided by its sum, and the product accumulated as R <- A_l · R from layer 0 up, R = I before
  layer 0: the final rollout is A_{L-1} ··· A_0. Importance of position j = Σ_i R[i, j] (`on_step_end`:
  `_attn_rollout.sum(dim=1)`). Because the last layer's factor is on the left, the column sum is
  1ᵀ A_{L-1} ··· A_0: a vector that must start at the LAST layer, so it cannot be accumulated bottom-up as one
  weighted column sum per layer. Two exact forms instead, neither with an S×S map: `rollout_importance`
  takes the per-layer head-mean rows of the computed queries [L, B, Tq, S] after the forward and runs the
  product top-down on vectors, O(L·Tq·S); `rollout_rows_init` / `rollout_rows_step` /
  `rollout_rows_importance` run bottom-up inside the layer loop with a [B, Tq, S] carry (the rollout's rows
  at the computed positions — the others stay identity rows because a step computes the same positions at
  every layer), O(L·Tq²·S).
* Certainty (`on_step_end`, `certainty_density`): score = cached confidence × Gaussian density (σ = `sigma`)
  of the decoded indicator over the generated positions (left boundary decoded; right boundary decoded only
  when the last position is; normaliser the kernel summed over 6G offsets); then the current block's
  positions get + max(score), the max over the whole batch array. `certainty_density` asserts σ > 0, so
  σ = 0 is not an official setting (the docs' "generation.sigma=0" switches off the certainty-prior
  *decoding*, not this cache score): refused here.
* Masked candidates (`on_step_end`): the first index where the running count of still-masked positions
  reaches `current_k` (G − 1 if never), rounded up to the end of its block (blocks of `block_mask.sum()`
  positions from generated position 0), searched from the current block's start; the top min(current_k, G)
  candidates by score. Dream (AR-shifted logits): the position before each selected one instead (the last
  generated position never), and the last prompt position is SET to whether generated position 0 was
  selected (an assignment: it can also clear a rollout pick there).
* Then every position decoded at step t (at its own position), then the rollout nucleus among the rest
  (`nucleus_select`, min_k 1: sorted descending, keep while the cumulative share <= rollout_p, always the
  first), then the inflation: a gap between two selected positions whose end-to-end distance is <= inflate_w
  is filled.
* Batch: at the next forward, active rows are topped up to the largest count (`top_up_mask`): unselected
  positions by rollout importance, the generated ones lifted by max + their certainty score.
* The confidence cache (`on_step_end`) is set to step 0's confidences and never changes: the update writes
  `cache[active][valid] = …`, an assignment into the copy that boolean-mask indexing returns
  (`frozen_confidence=True`, the default; False updates the positions whose logits the step computed and
  that were still masked before it).

The official sampler keeps those zero-filled positions as commit candidates (`src/generation/vanilla.py`
`generate_step`: its `transfer_index_mask[can_generate].logical_and_(valid_mask)` acts on a copy); the
sampler, not this module, must mirror that.

UNVERIFIED (not executed, only read): float rounding of the FFT density and of bf16 rollout products;
torch.topk's order among equal scores (ties are rare with real or random weights; we break them by the lowest
index). When fewer than `current_k` candidates are in the search window the official top-k pads with −inf
entries that are then filtered by "still masked"; we filter by "candidate", which is the same whenever no
masked position lies before the current block (always, with the sampler's blocks).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from dlm_jax.sampling.decoding_rules import certainty_density

_FAMILIES = ("llada", "dream", "mmada")
_TASKS = ("gsm8k", "humaneval", "math-500", "mbpp")


@dataclasses.dataclass(frozen=True)
class D2CacheSettings:
  """d2Cache's knobs (module docstring). Defaults are `configs/gen_args.py`'s d2cache entry (the same for
  every task and model there): rollout_p 0.1, current_k 32, sigma 10, inflate_w 0 — paired with certainty-prior
  decoding over one block of the whole generation. The docs' semi-AR + parallel example uses inflate_w 4 with
  blocks of 32 and no certainty prior (`published(..., parallel=True)`).

  frozen_confidence: mirror the official confidence cache that never updates after step 0 (True) or update it
    (False). batch_max_bonus: the current-block bonus is the max score over the whole batch (True, official)
    or over the row (False: a row's decision then does not depend on the other rows). top_up: equalise the
    per-row query counts of a batch as the official code does (True) or not. query_budget: static number of
    query rows a step may run (None: the whole sequence, always exact); a step whose selection exceeds it
    drops its highest positions and is not equal to the official one.
  """

  NAME: ClassVar[str] = "d2cache"
  rollout_p: float = 0.1
  current_k: int = 32
  sigma: float = 10.0
  inflate_w: int = 0
  frozen_confidence: bool = True
  batch_max_bonus: bool = True
  top_up: bool = True
  query_budget: int | None = None

  def __post_init__(self):
    self.check()

  def check(self) -> None:
    """Refuses, in one line, a knob out of range."""
    if not isinstance(self.rollout_p, (int, float)) or isinstance(self.rollout_p, bool) or not (
        0.0 < self.rollout_p <= 1.0):
      raise ValueError(f"d2cache rollout_p must be a number in (0, 1], got {self.rollout_p!r}.")
    if not isinstance(self.current_k, int) or isinstance(self.current_k, bool) or self.current_k < 1:
      raise ValueError(f"d2cache current_k must be an int >= 1, got {self.current_k!r}.")
    if not isinstance(self.sigma, (int, float)) or isinstance(self.sigma, bool) or not self.sigma > 0.0:
      raise ValueError(f"d2cache sigma must be a number > 0 (the official density asserts it), "
                       f"got {self.sigma!r}.")
    if not isinstance(self.inflate_w, int) or isinstance(self.inflate_w, bool) or self.inflate_w < 0:
      raise ValueError(f"d2cache inflate_w must be an int >= 0 (0 = no inflation), got {self.inflate_w!r}.")
    for name in ("frozen_confidence", "batch_max_bonus", "top_up"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"d2cache {name} must be True or False, got {getattr(self, name)!r}.")
    if self.query_budget is not None and (
        not isinstance(self.query_budget, int) or isinstance(self.query_budget, bool) or self.query_budget < 1):
      raise ValueError(f"d2cache query_budget must be None or an int >= 1, got {self.query_budget!r}.")

  @classmethod
  def published(cls, family: str, task: str = "gsm8k", parallel: bool = False) -> "D2CacheSettings":
    """The official values for a model family ("llada", "dream", "mmada") and task ("gsm8k", "humaneval",
    "math-500", "mbpp"). Source: Kamichanw/d2Cache `configs/gen_args.py` (`get_generation_args`, case
    "d2cache"): rollout_p 0.1, current_k 32, sigma 10, inflate_w 0 for every task and model (LLaDA and Dream
    Base/Instruct); the sampler there runs gen 256 (gsm8k, math-500) or 512 (humaneval, mbpp), steps = gen,
    block = gen, with the certainty-prior decoding (generation.sigma 10). MMaDA is not in the official code: it
    gets LLaDA's values (same architecture; our choice).

    parallel: the semi-AR + parallel setting of the official docs (`docs/kv_caching.md`: "cache.inflate_w=4
    generation.sigma=0", with `gen_args.py`'s comment "generation.block_length=32 cache.inflate_w=4"):
    inflate_w 4, the rest as above; the sampler then runs threshold (docs: 0.9) or factor decoding in blocks
    of 32 with steps = gen and no certainty prior."""
    if family not in _FAMILIES:
      raise ValueError(f"d2cache published family must be one of {', '.join(_FAMILIES)}, got {family!r}.")
    if task not in _TASKS:
      raise ValueError(f"d2cache published task must be one of {', '.join(_TASKS)}, got {task!r}.")
    if not isinstance(parallel, bool):
      raise ValueError(f"d2cache published parallel must be True or False, got {parallel!r}.")
    return cls(inflate_w=4) if parallel else cls()


def rollout_importance(rows: jax.Array, query_positions: jax.Array, query_valid: jax.Array) -> jax.Array:
  """Column sums of d2Cache's attention rollout, computed top-down on vectors (module docstring).

  rows [L, B, Tq, S]: per layer (layer 0 first), the head-MEAN softmax attention probabilities of the
  step's computed queries over all S keys (after masking; the forward provides them for every layer; at a
  full step Tq = S). query_positions [B, Tq] int32: the sequence position of each query row;
  query_valid [B, Tq] bool: False for padding rows. -> [B, S] float32, Σ_i R[i, j] with
  R = A_{L-1} ··· A_0, A_l's row i = (a_i + e_i) / (1 + Σ a_i) for computed i and e_i otherwise."""
  b, s = rows.shape[1], rows.shape[-1]
  rows = rows.astype(jnp.float32)
  batch = jnp.arange(b)[:, None]
  valid = query_valid.astype(jnp.float32)
  computed = jnp.zeros((b, s), jnp.float32).at[batch, query_positions].add(valid) > 0

  def layer(v, a):
    weight = jnp.take_along_axis(v, query_positions, axis=-1) / (1.0 + jnp.sum(a, axis=-1)) * valid
    spread = jnp.einsum("bt,bts->bs", weight, a, precision=jax.lax.Precision.HIGHEST)
    return jnp.where(computed, 0.0, v) + jnp.zeros_like(v).at[batch, query_positions].add(weight) + spread, None

  importance, _ = jax.lax.scan(layer, jnp.ones((b, s), jnp.float32), rows, reverse=True)
  return importance


def rollout_rows_init(query_positions: jax.Array, query_valid: jax.Array, seq_len: int) -> jax.Array:
  """The bottom-up form's carry before layer 0: the rollout's rows at the computed queries, R = I.
  query_positions [B, Tq] int32, query_valid [B, Tq] bool. -> [B, Tq, S] float32."""
  return jax.nn.one_hot(query_positions, seq_len, dtype=jnp.float32) * query_valid[..., None]


def rollout_rows_step(carry: jax.Array, rows: jax.Array, query_positions: jax.Array,
                      query_valid: jax.Array) -> jax.Array:
  """One layer of the bottom-up form, inside the layer loop: R <- A_l · R keeps identity rows at uncomputed
  positions (the computed set is the same at every layer of a step), so only the Tq computed rows are carried.
  carry [B, Tq, S] (`rollout_rows_init`, then this function's output); rows [B, Tq, S]: this layer's head-mean
  attention probabilities of the computed queries. Row i becomes (a_i masked to uncomputed columns +
  Σ_t a_i[pos_t] · carry_t + carry_i) / (1 + Σ a_i). O(Tq²·S) per layer. -> [B, Tq, S] float32."""
  b, _, s = carry.shape
  rows = rows.astype(jnp.float32)
  computed = jnp.zeros((b, s), jnp.float32).at[jnp.arange(b)[:, None], query_positions].add(
      query_valid.astype(jnp.float32)) > 0
  at_queries = jnp.take_along_axis(rows, jnp.broadcast_to(query_positions[:, None, :], rows.shape[:2] +
                                                          query_positions.shape[-1:]), axis=-1)
  at_queries = at_queries * query_valid[:, None, :]
  mixed = jnp.einsum("bit,bts->bis", at_queries, carry, precision=jax.lax.Precision.HIGHEST)
  new = (jnp.where(computed[:, None, :], 0.0, rows) + mixed + carry) / (1.0 + jnp.sum(rows, axis=-1))[..., None]
  return new * query_valid[..., None]


def rollout_rows_importance(carry: jax.Array, query_positions: jax.Array, query_valid: jax.Array) -> jax.Array:
  """Column sums of the rollout from the bottom-up carry [B, Tq, S] after the last layer: the carried rows
  plus 1 at every uncomputed position (its identity row). Equal to `rollout_importance`. -> [B, S]."""
  b, _, s = carry.shape
  computed = jnp.zeros((b, s), jnp.float32).at[jnp.arange(b)[:, None], query_positions].add(
      query_valid.astype(jnp.float32)) > 0
  return jnp.where(computed, 0.0, 1.0) + jnp.sum(carry * query_valid[..., None], axis=1)


def update_confidence_cache(conf_cache: jax.Array, confidence: jax.Array, logits_computed: jax.Array,
                            was_masked: jax.Array, frozen: bool) -> jax.Array:
  """The cached confidence [B, G] after a step (G generated positions). Initialise it with step 0's
  confidence [B, G] (every position computed there). frozen=True (official): unchanged. frozen=False: the
  step's confidence where logits_computed [B, G] (the generated positions whose logits the step computed:
  for Dream the query before each) and was_masked [B, G] (masked before the step)."""
  if frozen:
    return conf_cache
  return jnp.where(logits_computed & was_masked, confidence, conf_cache)


def certainty_scores(conf_cache: jax.Array, remaining: jax.Array, block_mask: jax.Array, sigma: float,
                     batch_max_bonus: bool, active: jax.Array | None = None) -> jax.Array:
  """Cached confidence × certainty density of the decoded positions, plus the max score on the current
  block. conf_cache, remaining (still masked after the step), block_mask (the block of the step): [B, G];
  active [B] bool: the rows still generating (None: all), over which batch_max_bonus takes the max (the
  official arrays hold only those rows). -> [B, G] float32 (the official `_density_score`)."""
  scores = conf_cache.astype(jnp.float32) * certainty_density(~remaining, sigma)
  if batch_max_bonus:
    bonus = jnp.max(scores if active is None else jnp.where(active[:, None], scores, -jnp.inf))
  else:
    bonus = jnp.max(scores, axis=-1, keepdims=True)
  return jnp.where(block_mask, scores + bonus, scores)


def select_masked(scores: jax.Array, remaining: jax.Array, block_mask: jax.Array, current_k: int) -> jax.Array:
  """Top min(current_k, G) still-masked positions by score inside the search window (from the block start to
  the block boundary after the current_k-th masked position). scores, remaining, block_mask [B, G]
  -> [B, G] bool."""
  b, g = remaining.shape
  column = jnp.arange(g)
  reached = jnp.cumsum(remaining.astype(jnp.int32), axis=-1) >= current_k
  min_end = jnp.where(jnp.any(reached, axis=-1), jnp.argmax(reached, axis=-1), g - 1)
  block_size = jnp.maximum(jnp.sum(block_mask, axis=-1), 1)
  search_end = (min_end // block_size + 1) * block_size - 1
  block_start = jnp.argmax(block_mask, axis=-1)
  candidates = (column >= block_start[:, None]) & (column <= search_end[:, None]) & remaining
  _, picked = jax.lax.top_k(jnp.where(candidates, scores, -jnp.inf), min(current_k, g))
  return jnp.zeros((b, g), bool).at[jnp.arange(b)[:, None], picked].set(True) & candidates


def nucleus(importance: jax.Array, top_p: float, eligible: jax.Array) -> jax.Array:
  """Nucleus of importance [B, T] among eligible [B, T] bool: sorted descending, the positions whose
  cumulative share is <= top_p, and always the first. -> [B, T] bool."""
  b, t = importance.shape
  share = jnp.where(eligible, importance, 0.0)
  share = share / (jnp.sum(share, axis=-1, keepdims=True) + 1e-9)
  order = jnp.argsort(-share, axis=-1, stable=True)
  keep = (jnp.cumsum(jnp.take_along_axis(share, order, axis=-1), axis=-1) <= top_p) | (jnp.arange(t) < 1)
  keep = keep & jnp.take_along_axis(eligible, order, axis=-1)
  return jnp.zeros((b, t), bool).at[jnp.arange(b)[:, None], order].set(keep)


def inflate(selected: jax.Array, width: int) -> jax.Array:
  """Fills every gap between two selected positions of selected [B, T] bool whose distance (next − previous
  selected position) is <= width. -> [B, T] bool."""
  t = selected.shape[-1]
  position = jnp.arange(t)
  following = jax.lax.cummin(jnp.where(selected, position, t), axis=1, reverse=True)
  preceding = jax.lax.cummax(jnp.where(selected, position, -1), axis=1)
  return selected | ((following - preceding <= width) & (preceding >= 0) & (following < t))


def query_mask(settings: D2CacheSettings, *, remaining: jax.Array, block_mask: jax.Array, decoded: jax.Array,
               conf_cache: jax.Array, importance: jax.Array, shifted: bool,
               active: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """d2Cache's decision at the end of step t: the positions step t+1 runs (before the batch top-up).

  remaining [B, G] bool: generated positions still masked after step t; block_mask [B, G] bool: the block
  step t decoded in; decoded [B, G] bool: positions decoded at step t; conf_cache [B, G]: the cached
  confidence; importance [B, T]: `rollout_importance` of step t (T = P + G, prompt first); shifted: the
  family's logits are AR-shifted (Dream); active [B] bool: rows still generating (None: all).
  -> (q_mask [B, T] bool, density_score [B, G] float32 for `top_up`)."""
  b, g = remaining.shape
  prompt = importance.shape[-1] - g
  scores = certainty_scores(conf_cache, remaining, block_mask, settings.sigma, settings.batch_max_bonus, active)
  selected = select_masked(scores, remaining, block_mask, settings.current_k)
  response = jnp.concatenate([selected[:, 1:], jnp.zeros((b, 1), bool)], axis=-1) if shifted else selected
  q = jnp.concatenate([jnp.zeros((b, prompt), bool), response | decoded], axis=-1)
  q = q | nucleus(importance, settings.rollout_p, ~q)
  if shifted and prompt > 0:
    q = q.at[:, prompt - 1].set(selected[:, 0])
  if settings.inflate_w > 0:
    q = inflate(q, settings.inflate_w)
  return q, scores


def top_up(q_mask: jax.Array, importance: jax.Array, density_score: jax.Array, active: jax.Array) -> jax.Array:
  """The official batch equalisation at the next forward: every active row [B] bool gets the largest active
  count of q_mask [B, T], adding its best unselected positions by importance [B, T], the generated ones
  lifted by (max over the active rows' unselected importance) + density_score [B, G]. Inactive rows are
  returned unchanged. -> [B, T] bool."""
  b, t = q_mask.shape
  g = density_score.shape[-1]
  count = jnp.sum(q_mask, axis=-1)
  target = jnp.max(jnp.where(active, count, 0))
  combined = jnp.where(q_mask, -jnp.inf, importance.astype(jnp.float32))
  lift = jnp.max(jnp.where(active[:, None], combined, -jnp.inf))
  combined = combined.at[:, t - g:].add(lift + density_score)
  need = jnp.where(active, target - count, 0)
  order = jnp.argsort(-combined, axis=-1, stable=True)
  picked = jnp.zeros((b, t), bool).at[jnp.arange(b)[:, None], order].set(jnp.arange(t)[None, :] < need[:, None])
  return q_mask | picked
