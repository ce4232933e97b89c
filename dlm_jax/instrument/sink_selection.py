"""Choosing sinks from incoming attention, inside or outside a compiled loop (jnp, jit-friendly): the
normalised scores, the ε-rule (Rulli et al., Eq. 3), ranks and the top-K sinks. The definitions are in
`dlm_jax.analysis.sinks`' module docstring; interventions (`MaskPreviousSinks`) and the sampler's per-step
top sinks use these functions inside the loop, the analysis functions after it."""

from __future__ import annotations

from typing import Any, Literal

import jax.numpy as jnp

Normalise = Literal["sum", "mean", "zscore"]
ArrayLike = Any


def valid_or_ones(valid: ArrayLike | None, shape: tuple[int, ...]) -> jnp.ndarray:
  return jnp.ones(shape, bool) if valid is None else jnp.broadcast_to(jnp.asarray(valid, bool), shape)


def normalised_scores(incoming: ArrayLike, normalise: Normalise = "sum", valid: ArrayLike | None = None,
                      n_queries: ArrayLike | None = None) -> jnp.ndarray:
  """Sink scores c [..., S] float32 from the incoming attention C [..., S] (see the module docstring).

  valid: [..., S] bool (broadcastable), the keys that count (padding excluded); None = all.
  n_queries: number of queries summed into C, for "mean" (scalar or broadcastable to [..., 1]); default S.
  """
  c = jnp.asarray(incoming, jnp.float32)
  if normalise == "sum":
    return c
  if normalise == "mean":
    n = c.shape[-1] if n_queries is None else jnp.asarray(n_queries, jnp.float32)
    return c / n
  if normalise == "zscore":
    v = valid_or_ones(valid, c.shape)
    n = jnp.maximum(v.sum(-1, keepdims=True), 1)
    mu = jnp.where(v, c, 0.0).sum(-1, keepdims=True) / n
    var = jnp.where(v, (c - mu) ** 2, 0.0).sum(-1, keepdims=True) / n
    sigma = jnp.sqrt(var)
    return jnp.where(sigma > 0, (c - mu) / jnp.where(sigma > 0, sigma, 1.0), 0.0)
  raise ValueError(f"normalise must be 'sum', 'mean' or 'zscore', got {normalise!r}.")


def epsilon_rule(incoming: ArrayLike, eps: ArrayLike = 3.0, normalise: Normalise = "sum",
                 valid: ArrayLike | None = None, n_queries: ArrayLike | None = None) -> jnp.ndarray:
  """Rulli et al.'s sink test: bool [..., S], True where c_j > mean_{k≠j, valid} c_k + ε.

  incoming: [..., S] column sums of attention. eps: scalar or array broadcastable to [..., 1] (−inf lets
  every valid key pass). Invalid keys are never sinks; with fewer than two valid keys nothing is a sink.
  """
  c = normalised_scores(incoming, normalise, valid, n_queries)
  v = valid_or_ones(valid, c.shape)
  n = v.sum(-1, keepdims=True)
  total = jnp.where(v, c, 0.0).sum(-1, keepdims=True)
  others_mean = (total - c) / jnp.maximum(n - 1, 1)
  return v & (n > 1) & (c > others_mean + jnp.asarray(eps, jnp.float32))


def sink_ranks(scores: ArrayLike, candidates: ArrayLike | None = None) -> jnp.ndarray:
  """Rank of every key by descending score, int32 [..., S]: 0 = largest; ties go to the lower position.

  Keys outside `candidates` ([..., S] bool) are ranked after every candidate.
  """
  s = jnp.asarray(scores, jnp.float32)
  key = jnp.where(valid_or_ones(candidates, s.shape), -s, jnp.inf)
  order = jnp.argsort(key, axis=-1, stable=True)
  return jnp.argsort(order, axis=-1, stable=True).astype(jnp.int32)


def top_k_mask(scores: ArrayLike, k: ArrayLike, candidates: ArrayLike | None = None) -> jnp.ndarray:
  """bool [..., S]: the k highest-scoring candidate keys (ties: lower position first).

  k: int, or int array broadcastable to scores.shape[:-1] (data: one program serves every k; 0 = none).
  """
  s = jnp.asarray(scores)
  ranks = sink_ranks(s, candidates)
  k = jnp.asarray(k, jnp.int32)[..., None]
  return (ranks < k) & valid_or_ones(candidates, s.shape)


def top_k_sinks(incoming: ArrayLike, k: ArrayLike, eps: ArrayLike | None = None, normalise: Normalise = "sum",
                valid: ArrayLike | None = None, candidates: ArrayLike | None = None,
                n_queries: ArrayLike | None = None) -> jnp.ndarray:
  """bool [..., S]: the top-k keys by incoming attention C [..., S], among `candidates`, and — when eps is
  given — only those passing the ε-rule (computed over the `valid` keys), so possibly fewer than k.

  Ranking by C equals ranking by the ε-rule margin (the normalisations are increasing in C).
  """
  mask = top_k_mask(incoming, k, candidates)
  if eps is not None:
    mask = mask & epsilon_rule(incoming, eps, normalise, valid, n_queries)
  return mask


def top_k_positions(scores: ArrayLike, k: int, candidates: ArrayLike | None = None) -> jnp.ndarray:
  """int32 [..., k]: positions of the k highest-scoring candidates, best first (ties: lower position
  first); −1 where fewer than k candidates exist. k is static here."""
  s = jnp.asarray(scores, jnp.float32)
  cand = valid_or_ones(candidates, s.shape)
  order = jnp.argsort(jnp.where(cand, -s, jnp.inf), axis=-1, stable=True)[..., :k].astype(jnp.int32)
  return jnp.where(jnp.take_along_axis(cand, order, axis=-1), order, -1)
