"""Parallel-decoding transfer rules: which of a block's masked positions take their proposal at a step.

Each rule maps the confidence [B, W] of the proposals in a window (a block) and the candidates [B, W]
bool (masked positions that may be decoded) to the transferred positions [B, W] bool. Ties go to the
lowest index first (as everywhere in `dlm_jax.sampling`). The confidence is on one of two scales
(`SCALES`): "probability", p(x0) itself, or "log_odds", log p − log(1 − p) (`log_odds_confidence`), which
ranks the same way but does not saturate at 1 in float32; the rules' probability bounds (τ, 1 − f/(r + 1))
are mapped onto the confidence's scale, so both scales take the same decisions in exact arithmetic.

* `threshold_transfer` — Fast-dLLM (`reference/decoding_modes.md` §2): every candidate whose confidence
  is at least τ (equality accepted), and always the most confident candidate, so a row with a candidate
  transfers at least one token per step.
* `factor_transfer` — Fast-dLLM's factor rule (§3): with the n candidates sorted by confidence
  c_(1) ≥ c_(2) ≥ …, rank r is accepted when c_(r) ≥ 1 − f/(r + 1) (rank 1 always), and the accepted
  ranks form a prefix of that order. Two variants (`FACTOR_RULES`):
    "fast_dllm" — NVlabs' Fast-dLLM code (`get_transfer_index_dynamic`, July 2025 on; dInfer's
                  `parallel_strategy` likewise): its loop stops at the first failing rank and, when that
                  is the last rank n (only the last candidate fails), commits all n;
    "dllm"      — dllm's vectorised rule: exactly the accepted prefix;
    "research_dllm" — Research dLLM's `confidence_unmasking(factor=...)` (Kamichanw/d2Cache
                  `src/generation/vanilla.py`), the loop d2Cache's official runs use: rank r is accepted when
                  (r + 1)(1 − c_(r)) < f (strict, rank 1 included, computed so in float32 on the probability
                  scale), the count is the accepted prefix's length but n − 1 when every rank is accepted (its
                  loop's last value), and at least one (the fallback to the step's quota, one token when steps
                  per block equal the block length).
* `quota_threshold_transfer` — LLaDA2.0's sampler (§6; SDAR's `low_confidence_dynamic`): the candidates whose
  confidence exceeds τ (strictly) when there are at least the step's quota of them, else the quota's most
  confident candidates (at most all of them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dlm_jax.sampling.selection import select_top_k

FACTOR_RULES = ("fast_dllm", "dllm", "research_dllm")
"""The factor rule's variants (module docstring); "fast_dllm" is the original's and the default."""


SCALES = ("probability", "log_odds")
"""The confidence scales the rules take (module docstring)."""


def log_odds_confidence(logits: jax.Array, x0: jax.Array) -> jax.Array:
  """log p(x0) − log(1 − p(x0)) under softmax(logits), computed without forming p: l_x0 − logsumexp of the
  other logits, so confidences near 1 stay distinct (float32 p is exactly 1 once the other tokens' mass is
  below 6e-8). logits [..., V] float, x0 [...] int -> [...] in the logits' dtype (at least float32);
  −inf logits at x0 give the lowest finite value (p = 0 ranks below every p > 0 and ties among itself).
  """
  logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
  chosen = jnp.take_along_axis(logits, x0[..., None], axis=-1)[..., 0]
  one_hot = jnp.arange(logits.shape[-1]) == x0[..., None]
  others = jax.nn.logsumexp(jnp.where(one_hot, -jnp.inf, logits), axis=-1)
  score = chosen - others
  lowest = jnp.finfo(score.dtype).min
  return jnp.where(jnp.isnan(score), lowest, jnp.maximum(score, lowest))


def probability_bound(bound: jax.Array | float, scale: str, dtype) -> jax.Array:
  """A probability bound b on the confidence's scale: b itself, or log b − log(1 − b) (−inf for b <= 0,
  +inf for b >= 1). [...] -> [...] of dtype."""
  if scale not in SCALES:
    raise ValueError(f"confidence scale must be one of {', '.join(SCALES)}, got {scale!r}.")
  b = jnp.asarray(bound, jnp.float32)
  if scale == "probability":
    return b.astype(dtype)
  inside = jnp.clip(b, 1e-30, 1.0 - 1e-7)
  odds = jnp.log(inside) - jnp.log1p(-inside)
  return jnp.where(b <= 0, -jnp.inf, jnp.where(b >= 1, jnp.inf, odds)).astype(dtype)


def _candidate_confidence(confidence: jax.Array, candidates: jax.Array) -> jax.Array:
  """Confidence where a candidate, −inf elsewhere (compared in the confidence's own dtype)."""
  return jnp.where(candidates, confidence, -jnp.inf)


def threshold_transfer(confidence: jax.Array, candidates: jax.Array, threshold: float,
                       scale: str = "probability") -> jax.Array:
  """Candidates with confidence >= threshold (a probability, on `scale`), plus each row's most confident
  candidate. [B, W] -> [B, W]."""
  scores = _candidate_confidence(confidence, candidates)
  top = select_top_k(scores, 1) & candidates
  return candidates & ((scores >= probability_bound(threshold, scale, scores.dtype)) | top)


def factor_transfer(confidence: jax.Array, candidates: jax.Array, factor: float,
                    rule: str = "fast_dllm", scale: str = "probability") -> jax.Array:
  """The longest prefix (by descending confidence) with c_(r) >= 1 − factor/(r + 1), rank 1 always; with
  rule "fast_dllm" all n candidates when only the last fails (module docstring). [B, W] -> [B, W]."""
  if rule not in FACTOR_RULES:
    raise ValueError(f"factor rule must be one of {', '.join(FACTOR_RULES)}, got {rule!r}.")
  scores = _candidate_confidence(confidence, candidates)
  ordered = -jnp.sort(-scores, axis=-1, stable=True)
  rank = jnp.arange(1, scores.shape[-1] + 1)
  if rule == "research_dllm":
    return _research_dllm_factor(scores, ordered, rank, candidates, factor, scale)
  bound = jnp.where(rank == 1, -jnp.inf, probability_bound(1.0 - factor / (rank + 1.0), scale, ordered.dtype))
  accepted = (ordered >= bound) & (ordered > -jnp.inf)
  count = jnp.sum(jnp.cumprod(accepted, axis=-1), axis=-1)
  if rule == "fast_dllm":
    n = jnp.sum(candidates, axis=-1)
    count = jnp.where(count == n - 1, n, count)
  return select_top_k(scores, count) & candidates


def _research_dllm_factor(scores, ordered, rank, candidates, factor: float, scale: str) -> jax.Array:
  """`factor_transfer`'s "research_dllm" variant (module docstring) on the sorted scores. [B, W] -> [B, W]."""
  if scale == "probability":
    accepted = (rank + 1.0).astype(ordered.dtype) * (1.0 - ordered) < factor
  else:
    accepted = ordered > probability_bound(1.0 - factor / (rank + 1.0), scale, ordered.dtype)
  count = jnp.sum(jnp.cumprod(accepted & (ordered > -jnp.inf), axis=-1), axis=-1)
  n = jnp.sum(candidates, axis=-1)
  count = jnp.maximum(jnp.where(count == n, n - 1, count), jnp.minimum(n, 1))
  return select_top_k(scores, count) & candidates


def quota_threshold_transfer(confidence: jax.Array, candidates: jax.Array, threshold: float | None,
                             quota: jax.Array) -> jax.Array:
  """H = candidates with confidence > threshold (strict; none when threshold is None); H where `|H|` >= quota,
  else the min(quota, #candidates) most confident candidates. confidence, candidates [B, W], quota scalar or
  [B] int -> [B, W] bool."""
  scores = _candidate_confidence(confidence, candidates)
  high = candidates & (scores > threshold) if threshold is not None else jnp.zeros_like(candidates)
  quota = jnp.broadcast_to(jnp.asarray(quota, jnp.int32), confidence.shape[:1])
  fallback = select_top_k(scores, jnp.minimum(quota, jnp.sum(candidates, axis=-1))) & candidates
  return jnp.where((jnp.sum(high, axis=-1) >= quota)[:, None], high, fallback)
