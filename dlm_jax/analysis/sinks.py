"""Attention-sink metrics over incoming-attention statistics (pure functions, NumPy or JAX arrays in).

The input of most functions is the *incoming attention* of `ForwardOutput.incoming_attention`: for every
key position j, C_j = Σ_i A[i, j], the column sum of one softmax attention map over its queries. Shapes
use the axis letters of `dlm_jax.model.attention` and put the key axis S last; any leading axes (steps, layers
L, batch B, heads N) are carried through. Functions that return variable-size results (sets, run lengths,
token counts) work in NumPy and return Python/NumPy objects; the others are jnp and jit-friendly.

Definitions (see ../shared/reference/papers.md §A.3, §A.5, §B.2, §C1, §C2):

* ε-rule (Rulli et al., Eq. 3). With scores c_j (the normalised incoming attention, below), key j is a sink
  iff  c_j > (1/(n−1)) Σ_{k≠j} c_k + ε,  the sum running over the n valid keys. ε = 3 by default.
  Normalisations of c: "sum" (default) c_j = C_j, the un-normalised column sum — the only scale on which
  ε = 3 is meaningful (papers.md A.3 caveat); "mean" c_j = C_j / n_queries, the paper's literal Ā (with
  ε = 3 it never fires); "zscore" c_j = (C_j − μ)/σ over the valid keys (population σ), on which the
  same rule reads z_j · n/(n−1) > ε. All three are increasing in C_j, so the sinks are always the
  top-m keys by C for some m.
* Top-K sinks: the K keys with the largest C (ties: the lower position first), optionally only among the
  keys that pass the ε-rule (then fewer than K may be returned) and among candidate keys.
* Gu et al.'s Sink_k^ε, bidirectional analogue: α_k = C_k / (number of queries that see k) per (layer,
  head); Sink_k^ε = fraction of the L·N heads with α_k > ε (ε = 0.3 default). Causal: queries k..T−1.
* Moving sinks, on a trajectory over denoising steps of one (layer, head) or of an aggregate:
  the *largest sink* at a step is the sink with the highest score (−1 when no key is a sink);
  change rate = fraction of consecutive step pairs, both with a largest sink, whose positions differ;
  drift = mean `|Δ position|` (or signed Δ) of the largest sink over those pairs; lifetimes = lengths of
  the maximal runs of consecutive steps in which a position is a sink (runs cut by the end of the
  trajectory are counted as they are); centroid variance (Sink-Aware Pruning, C1): variance over steps
  of c_t = Σ_{j∈sinks_t} C_j·j / Σ_{j∈sinks_t} C_j.
* Sink-token counts (Rulli Table 2): the token id at every (step, layer, head, position) flagged as a
  sink, pooled.
* Value norms (Zhang et al. Fig. 1, App. A.3.2): ‖v_j‖₂ per kv head, compared between sink and normal
  tokens, either per head (each query head n paired with kv head n // G) or as the head-averaged r̄_j.
"""

from __future__ import annotations

import collections

import jax.numpy as jnp
import numpy as np

from dlm_jax.instrument.sink_selection import (valid_or_ones, ArrayLike, epsilon_rule, Normalise)

def gu_sink_ratio(incoming: ArrayLike, eps: float = 0.3, causal: bool = False,
                  n_queries: int | None = None) -> jnp.ndarray:
  """Gu et al.'s Sink_k^ε for every position k: float32 [..., S] from incoming [..., L, N, S].

  α_k = C_k / m_k per (layer, head), with m_k = n_queries (default S) queries for bidirectional attention
  and m_k = T − k for causal attention over T = n_queries (default S) queries; the result is the fraction
  of the L·N heads with α_k > eps. Position k = 0 gives Gu's Sink_1.
  """
  c = jnp.asarray(incoming, jnp.float32)
  s = c.shape[-1]
  t = s if n_queries is None else n_queries
  m = jnp.maximum(t - jnp.arange(s), 1) if causal else jnp.full((s,), t)
  alpha = c / m
  return jnp.mean((alpha > eps).astype(jnp.float32), axis=(-3, -2))


def sink_sets_per_step(sink_mask: ArrayLike) -> list[set]:
  """One set per step from a bool sink mask [steps, ..., S] (e.g. `epsilon_rule(incoming)`).

  Elements are index tuples (l, ..., s) over the non-step axes ((s,) for a [steps, S] mask).
  """
  mask = np.asarray(sink_mask, bool)
  return [set(map(tuple, np.argwhere(step).tolist())) for step in mask]


def largest_sink_positions(incoming: ArrayLike, eps: float | None = 3.0, normalise: Normalise = "sum",
                           valid: ArrayLike | None = None) -> jnp.ndarray:
  """int32 [...]: position of the largest sink in incoming [..., S] (the sink with the highest C; ties:
  lower position); −1 where no key is a sink. eps=None: the plain argmax (every entry defined)."""
  c = jnp.asarray(incoming, jnp.float32)
  is_sink = valid_or_ones(valid, c.shape) if eps is None else epsilon_rule(c, eps, normalise, valid)
  best = jnp.argmax(jnp.where(is_sink, c, -jnp.inf), axis=-1).astype(jnp.int32)
  return jnp.where(is_sink.any(-1), best, -1)


def _consecutive_pairs(positions: ArrayLike) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  p = np.asarray(positions)
  prev, cur = p[:-1], p[1:]
  return prev, cur, (prev >= 0) & (cur >= 0)


def largest_sink_change_rate(positions: ArrayLike) -> np.ndarray:
  """float [...]: over consecutive steps (t−1, t) that both have a largest sink, the fraction where its
  position changed. positions: int [steps, ...] (−1 = none); NaN where no such pair exists."""
  prev, cur, both = _consecutive_pairs(positions)
  n = both.sum(0)
  changed = ((prev != cur) & both).sum(0)
  with np.errstate(invalid="ignore", divide="ignore"):
    return np.where(n > 0, changed / np.maximum(n, 1), np.nan)


def largest_sink_drift(positions: ArrayLike, signed: bool = False) -> np.ndarray:
  """float [...]: mean `|p_t − p_{t−1}|` (signed: mean p_t − p_{t−1}; > 0 moves right) of the largest
  sink over consecutive steps that both have one. positions: int [steps, ...]; NaN without pairs."""
  prev, cur, both = _consecutive_pairs(positions)
  delta = (cur - prev).astype(np.float64)
  delta = delta if signed else np.abs(delta)
  n = both.sum(0)
  return np.where(n > 0, np.where(both, delta, 0.0).sum(0) / np.maximum(n, 1), np.nan)


def sink_lifetimes(sink_mask: ArrayLike) -> np.ndarray:
  """int64 [R]: lengths (in steps) of every maximal run of consecutive steps in which one position (of one
  series) is a sink. sink_mask: bool [steps, ..., S]; every non-step index is a separate series.
  Runs are listed series by series in C order, each series' runs in time order."""
  mask = np.asarray(sink_mask, bool)
  series = mask.reshape(mask.shape[0], -1).T.astype(np.int8)
  padded = np.pad(series, ((0, 0), (1, 1)))
  edges = np.diff(padded, axis=1)
  starts = np.argwhere(edges == 1)
  stops = np.argwhere(edges == -1)
  return (stops[:, 1] - starts[:, 1]).astype(np.int64)


def sink_centroids(incoming: ArrayLike, sink_mask: ArrayLike) -> jnp.ndarray:
  """float32 [steps, ...]: c_t = Σ_{j sink} C_j·j / Σ_{j sink} C_j (NaN at steps without sinks).
  incoming and sink_mask: [steps, ..., S]."""
  c = jnp.asarray(incoming, jnp.float32)
  m = jnp.asarray(sink_mask, bool)
  weight = jnp.where(m, c, 0.0)
  mass = weight.sum(-1)
  centroid = (weight * jnp.arange(c.shape[-1])).sum(-1) / jnp.where(mass > 0, mass, 1.0)
  return jnp.where(m.any(-1), centroid, jnp.nan)


def moving_sink_summary(incoming: ArrayLike, eps: float = 3.0, normalise: Normalise = "sum",
                        valid: ArrayLike | None = None) -> dict[str, float]:
  """Moving-sink measures of one trajectory incoming [steps, S] (one head, or an aggregate over heads).

  Returns change_rate, drift, signed_drift (largest sink), mean_lifetime (all sink runs),
  centroid_variance (over steps with sinks; NaN if none), steps_with_sink.
  """
  c = jnp.asarray(incoming, jnp.float32)
  if c.ndim != 2:
    raise ValueError(f"moving_sink_summary expects incoming [steps, S], got shape {c.shape}.")
  mask = epsilon_rule(c, eps, normalise, valid)
  positions = np.asarray(largest_sink_positions(c, eps, normalise, valid))
  lifetimes = sink_lifetimes(mask)
  centroids = np.asarray(sink_centroids(c, mask))
  defined = centroids[~np.isnan(centroids)]
  return {
      "change_rate": float(largest_sink_change_rate(positions)),
      "drift": float(largest_sink_drift(positions)),
      "signed_drift": float(largest_sink_drift(positions, signed=True)),
      "mean_lifetime": float(lifetimes.mean()) if lifetimes.size else float("nan"),
      "centroid_variance": float(defined.var()) if defined.size else float("nan"),
      "steps_with_sink": int((positions >= 0).sum()),
  }


def sink_token_counts(sink_mask: ArrayLike, tokens: ArrayLike) -> collections.Counter:
  """Counter {token id: number of (…, position) entries flagged as a sink} (Rulli Table 2, pooled).

  sink_mask: bool [..., S]; tokens: int ids broadcastable to it, e.g. a [steps, L, B, N, S] mask with
  tokens [steps, 1, B, 1, S] (the sequence of each step).
  """
  mask = np.asarray(sink_mask, bool)
  ids = np.broadcast_to(np.asarray(tokens), mask.shape)[mask]
  values, counts = np.unique(ids, return_counts=True)
  return collections.Counter(dict(zip(values.tolist(), counts.tolist())))


def relative_frequencies(counts: collections.Counter) -> dict[int, float]:
  """{token id: count / total}, most frequent first (Table 2's relative frequencies)."""
  total = sum(counts.values())
  return {token: n / total for token, n in counts.most_common()} if total else {}


def value_norm_samples(value_norms: ArrayLike, sink_mask: ArrayLike, valid: ArrayLike | None = None, *,
                       per_head: bool = True) -> tuple[np.ndarray, np.ndarray]:
  """Value-vector norms of sink and of normal tokens, as two flat float arrays.

  value_norms: [L, B, K, S] (`ForwardOutput.value_norms`). sink_mask: per_head=True: [L, B, N, S] per query
  head, each entry paired with kv head n // (N/K); per_head=False: [L, B, S] per layer, paired with the
  head-averaged norm r̄ = mean over the K kv heads (Zhang et al. App. A.3.2). valid: [B, S] bool, keys to
  include.
  """
  norms = np.asarray(value_norms, np.float64)
  mask = np.asarray(sink_mask, bool)
  expected = "[L, B, N, S]" if per_head else "[L, B, S]"
  if mask.ndim != (4 if per_head else 3):
    raise ValueError(f"sink_mask must be {expected} with per_head={per_head}, got shape {mask.shape}.")
  valid = np.ones(mask.shape[1:2] + mask.shape[-1:], bool) if valid is None else np.asarray(valid, bool)
  if per_head:
    norms = np.repeat(norms, mask.shape[2] // norms.shape[2], axis=2)
    keep = np.broadcast_to(valid[None, :, None], mask.shape)
  else:
    norms = norms.mean(2)
    keep = np.broadcast_to(valid[None], mask.shape)
  return norms[mask & keep], norms[~mask & keep]


def value_norm_summary(value_norms: ArrayLike, sink_mask: ArrayLike, valid: ArrayLike | None = None, *,
                       per_head: bool = True) -> dict[str, float]:
  """Mean, std and count of value norms for sink and normal tokens (see `value_norm_samples`)."""
  sink, normal = value_norm_samples(value_norms, sink_mask, valid, per_head=per_head)

  def stats(x):
    return (float(x.mean()), float(x.std())) if x.size else (float("nan"), float("nan"))

  (sink_mean, sink_std), (normal_mean, normal_std) = stats(sink), stats(normal)
  return {"sink_mean": sink_mean, "sink_std": sink_std, "sink_count": int(sink.size),
          "normal_mean": normal_mean, "normal_std": normal_std, "normal_count": int(normal.size)}


# ----------------------------------------------------------------------------------------------------------
# Helpers for the experiment binaries (per-step traces of samplers).


def relative_scores(incoming: ArrayLike, valid: ArrayLike | None = None) -> jnp.ndarray:
  """Incoming attention relative to the uniform share: c_j = C_j / mean_{valid k} C_k, float32 [..., S]
  (0 at invalid keys; 0 everywhere when no valid key receives attention).

  For a bidirectional map over all S queries with every key valid, mean C = 1, so c = C (the "sum"
  scale of the ε-rule, unchanged). For one causal query row over n written keys (an autoregressive
  decoding step), c_j = n·A[j], which puts that row on the same scale: ε = 3 then means "more than four
  times the uniform share" in both cases.
  """
  c = jnp.asarray(incoming, jnp.float32)
  v = valid_or_ones(valid, c.shape)
  n = v.sum(-1, keepdims=True)
  mean = jnp.where(v, c, 0.0).sum(-1, keepdims=True) / jnp.maximum(n, 1)
  return jnp.where(v & (mean > 0), c / jnp.where(mean > 0, mean, 1.0), 0.0)


def sink_counts_over_epsilon(scores: ArrayLike, epsilons: ArrayLike, valid: ArrayLike | None = None) -> np.ndarray:
  """int64 [E]: number of (…, key) entries of scores [..., S] that pass the ε-rule (normalise="sum")
  for each ε of `epsilons` [E], counting valid keys only (Rulli Fig. 10 is 1 − count / valid count)."""
  c = jnp.asarray(scores, jnp.float32)
  return np.asarray([int(epsilon_rule(c, float(e), "sum", valid).sum()) for e in np.asarray(epsilons)], np.int64)


def main_sink_disagreement(group_a: ArrayLike, group_b: ArrayLike, active: ArrayLike) -> tuple[int, int]:
  """(disagreeing, compared): over the entries where `active` [...] is True, how often the key with the
  most incoming attention from query group a ([..., S], e.g. masked queries) differs from group b's
  (e.g. unmasked queries); Rulli Fig. 6a's "separate sinks" (ties: the lower position)."""
  a = np.argmax(np.asarray(group_a), axis=-1)
  b = np.argmax(np.asarray(group_b), axis=-1)
  act = np.asarray(active, bool)
  return int(((a != b) & act).sum()), int(act.sum())


def step_sequences(tokens: ArrayLike, decode_step: ArrayLike, prompt_length: int, n_steps: int, *,
                   mask_id: int | None = None, fill_id: int = -1) -> np.ndarray:
  """int [steps, B, S]: the sequence each model call of a sampler saw, rebuilt from its `Trace`.

  tokens: [B, S] final sequence; decode_step: [B, G] step that produced (or unmasked) each generated
  position, −1 if none. Diffusion samplers (mask_id given): at step t a generated position holds its final
  token if decode_step < t, else the mask token (exact when no token is re-masked, as in LLaDA and Dream).
  Autoregressive (mask_id None): at step t the positions < prompt_length + t hold their tokens (step 0 is
  the prefill) and the others `fill_id` (not written yet).
  """
  tokens = np.asarray(tokens)
  decode = np.asarray(decode_step)
  steps = np.arange(n_steps)[:, None, None]
  out = np.broadcast_to(tokens, (n_steps,) + tokens.shape).copy()
  gen = out[:, :, prompt_length:]
  if mask_id is not None:
    hidden = (decode[None] < 0) | (decode[None] >= steps)
    gen[hidden] = mask_id
  else:
    written = np.arange(gen.shape[-1])[None, None, :] < steps
    gen[~np.broadcast_to(written, gen.shape)] = fill_id
  return out


def uniform_step_sequences(tokens: ArrayLike, canvases: ArrayLike, queries: ArrayLike, *, fill_id: int = -1
                           ) -> np.ndarray:
  """int [steps, S]: the sequence each decoder step of a uniform-state sampler (DiffusionGemma) saw, for one
  row: the final tokens [S] before the step's canvas (the prompt and the canvases committed to the cache),
  the step's own canvas [C] (`Trace.canvases`, noisy: accepted samples and renoised ids) at its computed
  queries [start, start + C) (`Trace.computed_queries` [steps, 2]), and `fill_id` after it (not generated
  yet)."""
  tokens, canvases, queries = np.asarray(tokens), np.asarray(canvases), np.asarray(queries)
  steps, width = canvases.shape
  out = np.broadcast_to(tokens, (steps, tokens.shape[0])).copy()
  for t in range(steps):
    start = int(queries[t, 0])
    out[t, start:start + width] = canvases[t]
    out[t, start + width:] = fill_id
  return out
