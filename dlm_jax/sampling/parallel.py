"""Parallel-decoding transfer rules: which of a block's masked positions take their proposal at a step.

Each rule maps the confidence [B, W] of the proposals in a window (a block) and the candidates [B, W]
bool (masked positions that may be decoded) to the transferred positions [B, W] bool. Ties go to the
lowest index first (as everywhere in `dlm_jax.sampling`).

* `threshold_transfer` — Fast-dLLM (`reference/decoding_modes.md` §2): every candidate whose confidence
  is at least τ (equality accepted), and always the most confident candidate, so a row with a candidate
  transfers at least one token per step.
* `factor_transfer` — Fast-dLLM's factor rule (§3): with the n candidates sorted by confidence
  c_(1) ≥ c_(2) ≥ …, rank r is accepted when c_(r) ≥ 1 − f/(r + 1) (rank 1 always), and the accepted
  ranks form a prefix of that order. Two variants (`FACTOR_RULES`):
    "fast_dllm" — NVlabs' Fast-dLLM code (`get_transfer_index_dynamic`, July 2025 on; dInfer's
                  `parallel_strategy` likewise): its loop stops at the first failing rank and, when that
                  is the last rank n (only the last candidate fails), commits all n;
    "dllm"      — dllm's vectorised rule: exactly the accepted prefix.
* `quota_threshold_transfer` — LLaDA2.0's sampler (§6; SDAR's `low_confidence_dynamic`): the candidates whose
  confidence exceeds τ (strictly) when there are at least the step's quota of them, else the quota's most
  confident candidates (at most all of them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dlm_jax.sampling.selection import select_top_k

FACTOR_RULES = ("fast_dllm", "dllm")
"""The factor rule's variants (module docstring); "fast_dllm" is the original's and the default."""


def _candidate_confidence(confidence: jax.Array, candidates: jax.Array) -> jax.Array:
  """Confidence where a candidate, −inf elsewhere (compared in the confidence's own dtype)."""
  return jnp.where(candidates, confidence, -jnp.inf)


def threshold_transfer(confidence: jax.Array, candidates: jax.Array, threshold: float) -> jax.Array:
  """Candidates with confidence >= threshold, plus each row's most confident candidate. [B, W] -> [B, W]."""
  scores = _candidate_confidence(confidence, candidates)
  top = select_top_k(scores, 1) & candidates
  return candidates & ((scores >= threshold) | top)


def factor_transfer(confidence: jax.Array, candidates: jax.Array, factor: float,
                    rule: str = "fast_dllm") -> jax.Array:
  """The longest prefix (by descending confidence) with c_(r) >= 1 − factor/(r + 1), rank 1 always; with
  rule "fast_dllm" all n candidates when only the last fails (module docstring). [B, W] -> [B, W]."""
  if rule not in FACTOR_RULES:
    raise ValueError(f"factor rule must be one of {', '.join(FACTOR_RULES)}, got {rule!r}.")
  scores = _candidate_confidence(confidence, candidates)
  ordered = -jnp.sort(-scores, axis=-1, stable=True)
  rank = jnp.arange(1, scores.shape[-1] + 1)
  bound = jnp.where(rank == 1, -jnp.inf, 1.0 - factor / (rank + 1.0)).astype(ordered.dtype)
  accepted = (ordered >= bound) & jnp.isfinite(ordered)
  count = jnp.sum(jnp.cumprod(accepted, axis=-1), axis=-1)
  if rule == "fast_dllm":
    n = jnp.sum(candidates, axis=-1)
    count = jnp.where(count == n - 1, n, count)
  return select_top_k(scores, count) & candidates


def quota_threshold_transfer(confidence: jax.Array, candidates: jax.Array, threshold: float | None,
                             quota: jax.Array) -> jax.Array:
  """H = candidates with confidence > threshold (strict; none when threshold is None); H where |H| >= quota,
  else the min(quota, #candidates) most confident candidates. confidence, candidates [B, W], quota scalar or
  [B] int -> [B, W] bool."""
  scores = _candidate_confidence(confidence, candidates)
  high = candidates & (scores > threshold) if threshold is not None else jnp.zeros_like(candidates)
  quota = jnp.broadcast_to(jnp.asarray(quota, jnp.int32), confidence.shape[:1])
  fallback = select_top_k(scores, jnp.minimum(quota, jnp.sum(candidates, axis=-1))) & candidates
  return jnp.where((jnp.sum(high, axis=-1) >= quota)[:, None], high, fallback)
