"""Elastic-Cache (arXiv 2510.14973): a sliding window of masked queries plus a per-layer drift test of the
most-attended tokens that decides from which layer on a call recomputes every position. Rules as read in the
official code through its mirror yxu-dev/Elastic-Cache: `llada/generate.py` (`generate_with_elastic_cache`,
`get_decoded_token_confident`, `get_decoded_token_topk`), `llada/model/modeling_llada.py` (`LLaDABlock.attention`),
scripts `llada/eval_*.sh`, `dream/eval_*.sh`, `llada/eval_llada.py`. Facts only; no code of theirs is copied.

What the official code does (batch 1):

* Call 0 runs every position through every layer. Later calls run the query set = tracked tokens ∪ positions
  decoded at the previous call ∪ the first `window_length` still-masked positions (all still-masked ones
  when `block_caching` is False; the logits are then cut to the first `window_length`). Their K/V/Q rows
  overwrite the per-layer caches (post-RoPE); attention reads all S cached keys.
* Tracked tokens (`attention`, every layer, every call): the layer's softmax attention probabilities of the
  call's masked query rows (the window's, or every still-masked one without block caching) summed over batch,
  heads and those rows -> one score per key; still-masked positions set to 0; the top `track_num`. The next
  call tracks the union over layers (`generate`: `torch.cat(...).unique`).
* Drift (`attention`, at every layer below the refresh start): for the tracked tokens, their previous attention
  rows softmax(q_prev · K_prevᵀ / √head_dim) (q_prev: their cached Q rows; K_prev: the K cache before this
  call's update) against their current rows (fresh Q against the updated K cache), cosine similarity over
  the HEAD axis (`F.cosine_similarity(..., dim=1)`), then the mean over tracked tokens and all S keys. If it
  is < gamma at layer l, the refresh start becomes l + 1: layer l + 1 takes the cached hidden states of
  every position (fresh at the query rows) and every layer from there on runs all positions and replaces its
  caches. A drift at the last layer changes nothing; only the first drifted layer matters (later layers are
  full and compute no drift).
* Decoding (`get_decoded_token_confident`): among the window's positions, every one whose top probability
  (softmax in float64) is >= min(threshold, the window's largest) — at least the best; with threshold None,
  the top `tokens_per_iter`. After the first call that decodes an EOS (id 126081), the still-masked set is
  cut to the positions before the smallest EOS decoded at that call (once: later EOS decodes do not cut
  again); positions after the cut stay [MASK] in the output. The loop ends when the set is empty (NFE =
  calls). Counting: fraction of layers recomputed = Σ (L − refresh start) / Σ L, call 0 counting L + 1.

Defaults (signature of `generate_with_elastic_cache`; `llada/eval_gsm8k.sh`): gen 512, window 16, threshold
0.9, gamma 0.9, track_num 1, block_caching True, batch 1. The LLaDA scripts set `window_length=16` but do not
pass it on (and their `block_length` is unset), so `eval_llada.py`'s default window_length 1024 (>= gen 512:
the window is every masked position) is what those scripts run; Dream's scripts pass it (GSM8K 32, HumanEval 16
with gamma 0.98).

Batched, each row decides alone here (the official sums the tracked-token scores and means the drift over
the batch too, with batch 1). Keys of padding (key_valid False) are left out of the drift mean (the official
has none). UNVERIFIED: float64 vs float32 probabilities at the threshold boundary; torch.topk tie order.

Dream (`dream/model/generation_utils_elastic.py` `_sample`, `dream/model/modeling_dream.py`
`DreamSdpaAttention.forward`): the same rules with the AR shift — the masked queries are the positions before
the window's masked positions (their rows are the tracked-token statistic's rows; the still-masked positions,
unshifted, are zeroed), decoded positions are the window's; the caches hold K/V after `repeat_kv`, so a query
head n reads key head n // (N / K), as here; its attention applies no padding mask. The query set is a
concatenation that can name a position twice (both copies compute the same row: the union here). Its decoding
(`get_transfer_index_fast`): Dream's `sample_tokens` with the generation config's temperature, top-p and top-k
on the window's logits (rows window − 1; `alg` unused), every position with p(x0) >= min(threshold, the
window's largest), the EOS cut as above with `eos_id` = the tokenizer's `eos_token_id` (`dream/eval.py`); no
blocks, the loop ends when the masked set is empty (`steps` unused). Wired in
`dlm_jax.policy.elastic_cache_policy` (`query_mask(shifted=True)`, `predecessors` for the statistic's rows); the
decoding is `dlm_jax.sampling.dream_window` (`dream.elastic_cache_options()`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp

# (window_length, gamma) per family and task, from the official scripts (module docstring).
_PUBLISHED = {
    "llada": {"gsm8k": (16, 0.9), "humaneval": (16, 0.9), "minerva_math": (16, 0.9), "mbpp": (16, 0.9)},
    "dream": {"gsm8k": (32, 0.9), "humaneval": (16, 0.98)},
}


@dataclasses.dataclass(frozen=True)
class ElasticCacheSettings:
  """Elastic-Cache's knobs (module docstring). threshold None decodes the top `tokens_per_iter` per call
  instead. eos_truncation: after the first call that decodes an EOS, positions after it are never decoded
  (True, official) or decoding continues to the end (False)."""

  NAME: ClassVar[str] = "elastic_cache"
  window_length: int = 16
  gamma: float = 0.9
  track_num: int = 1
  block_caching: bool = True
  threshold: float | None = 0.9
  tokens_per_iter: int = 1
  eos_truncation: bool = True

  def __post_init__(self):
    self.check()

  def check(self) -> None:
    """Refuses, in one line, a knob out of range."""
    for name in ("window_length", "track_num", "tokens_per_iter"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"elastic_cache {name} must be an int >= 1, got {value!r}.")
    if not isinstance(self.gamma, (int, float)) or isinstance(self.gamma, bool) or not 0.0 < self.gamma <= 1.0:
      raise ValueError(f"elastic_cache gamma must be a number in (0, 1], got {self.gamma!r}.")
    if self.threshold is not None and (not isinstance(self.threshold, (int, float)) or isinstance(
        self.threshold, bool) or not 0.0 < self.threshold <= 1.0):
      raise ValueError(f"elastic_cache threshold must be None or a number in (0, 1], got {self.threshold!r}.")
    for name in ("block_caching", "eos_truncation"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"elastic_cache {name} must be True or False, got {getattr(self, name)!r}.")

  def query_budget(self, n_layers: int, seq_len: int) -> int:
    """A static number of query rows that every call after the first fits exactly: with block caching at most
    n_layers · track_num tracked tokens + window_length decoded at the previous call (decoding only reads the
    window) + window_length window positions, capped at seq_len; without block caching, seq_len."""
    if not self.block_caching:
      return seq_len
    return min(seq_len, n_layers * self.track_num + 2 * self.window_length)

  @classmethod
  def published(cls, family: str, task: str = "gsm8k") -> "ElasticCacheSettings":
    """Official values for family "llada" (tasks gsm8k, humaneval, minerva_math, mbpp: window 16 as the
    scripts write it, gamma 0.9; `llada/eval_*.sh`), "dream" (gsm8k: window 32, gamma 0.9; humaneval:
    window 16, gamma 0.98; `dream/eval_*.sh`) or "mmada" (not in the official code: LLaDA's values, same
    architecture; our choice); threshold 0.9 and track_num 1 everywhere, gen 512."""
    key = "llada" if family == "mmada" else family
    if key not in _PUBLISHED:
      raise ValueError(f"elastic_cache published family must be one of llada, dream, mmada, got {family!r}.")
    if task not in _PUBLISHED[key]:
      raise ValueError(f"elastic_cache published task for {family} must be one of "
                       f"{', '.join(_PUBLISHED[key])}, got {task!r}.")
    window, gamma = _PUBLISHED[key][task]
    return cls(window_length=window, gamma=gamma)


def track_tokens(incoming: jax.Array, pending: jax.Array, track_num: int) -> jax.Array:
  """One layer's most-attended tokens. incoming [B, N, S] (or [B, S] already summed over heads): the layer's
  softmax attention probabilities of the call's masked query rows summed over those rows, per head, over all
  S keys; pending [B, S] bool: the still-masked set of the call (`pending_mask`), zeroed before the top-k.
  -> [B, track_num] int32, ascending."""
  score = jnp.sum(incoming, axis=1) if incoming.ndim == 3 else incoming
  score = jnp.where(pending, 0.0, score.astype(jnp.float32))
  _, top = jax.lax.top_k(score, track_num)
  return jnp.sort(top, axis=-1).astype(jnp.int32)


def tracked_mask(per_layer: jax.Array, seq_len: int) -> jax.Array:
  """Union over layers of `track_tokens` results [L, B, track_num] -> [B, S] bool."""
  n_layers, b, k = per_layer.shape
  index = jnp.moveaxis(per_layer, 0, 1).reshape(b, n_layers * k)
  return jnp.zeros((b, seq_len), bool).at[jnp.arange(b)[:, None], index].set(True)


def attention_rows(q: jax.Array, k: jax.Array, key_valid: jax.Array | None = None) -> jax.Array:
  """Softmax attention rows of the tracked tokens: q [B, T, N, H] (post-RoPE queries), k [B, S, K, H]
  (post-RoPE keys, K divides N; query head n reads key head n // (N / K)), scale 1/√H, key_valid [B, S] bool
  (None: all). -> [B, N, T, S] float32."""
  b, t, n, h = q.shape
  k = jnp.repeat(k, n // k.shape[2], axis=2)
  logits = jnp.einsum("btnh,bsnh->bnts", q.astype(jnp.float32), k.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST) / math.sqrt(h)
  if key_valid is not None:
    logits = jnp.where(key_valid[:, None, None, :], logits, -jnp.inf)
  return jax.nn.softmax(logits, axis=-1)


def drift_similarity(previous: jax.Array, current: jax.Array, row_valid: jax.Array,
                     key_valid: jax.Array | None = None) -> jax.Array:
  """Elastic-Cache's similarity of the tracked tokens' previous and current attention rows, both [B, N, T, S]
  (`attention_rows`): cosine over the head axis N (x·y / max(norm(x)·norm(y), 1e-8)), then the mean over
  valid rows row_valid [B, T] and valid keys key_valid [B, S] (None: all). A row with no valid tracked token
  gets 1 (no drift). -> [B] float32."""
  dot = jnp.sum(previous * current, axis=1)
  norms = jnp.sqrt(jnp.sum(previous * previous, axis=1)) * jnp.sqrt(jnp.sum(current * current, axis=1))
  cosine = dot / jnp.maximum(norms, 1e-8)
  weight = jnp.broadcast_to(row_valid[:, :, None], cosine.shape).astype(jnp.float32)
  if key_valid is not None:
    weight = weight * key_valid[:, None, :].astype(jnp.float32)
  total = jnp.sum(weight, axis=(1, 2))
  return jnp.where(total > 0, jnp.sum(cosine * weight, axis=(1, 2)) / jnp.maximum(total, 1.0), 1.0)


def refresh_start(similarity: jax.Array, gamma: float) -> jax.Array:
  """First layer recomputed for every position: l + 1 for the first layer l whose similarity [L, B] is below
  gamma, L when none is (nothing refreshed). Similarities at layers >= the start are ignored (the official
  code does not compute them). -> [B] int32."""
  n_layers = similarity.shape[0]
  drifted = similarity < gamma
  first = jnp.argmax(drifted, axis=0)
  return jnp.where(jnp.any(drifted, axis=0), first + 1, n_layers).astype(jnp.int32)


def pending_mask(still_masked: jax.Array, eos_cut: jax.Array) -> jax.Array:
  """The official still-masked set: masked positions still_masked [B, S] up to eos_cut [B] int32 (S when no
  EOS cut applies). -> [B, S] bool."""
  return still_masked & (jnp.arange(still_masked.shape[-1])[None, :] <= eos_cut[:, None])


def update_eos_cut(eos_cut: jax.Array, committed: jax.Array, is_eos: jax.Array) -> jax.Array:
  """eos_cut [B] int32 after a call: unchanged once set (< S); otherwise the smallest position the call
  committed [B, S] bool with an EOS token is_eos [B, S] bool, or S when none. -> [B] int32."""
  s = committed.shape[-1]
  first = jnp.min(jnp.where(committed & is_eos, jnp.arange(s)[None, :], s), axis=-1)
  return jnp.where(eos_cut < s, eos_cut, first).astype(jnp.int32)


def query_mask(settings: ElasticCacheSettings, tracked: jax.Array, decoded_last: jax.Array,
               pending: jax.Array, shifted: bool = False) -> tuple[jax.Array, jax.Array]:
  """The positions a call after the first runs, and its decoding window. tracked [B, S] bool
  (`tracked_mask` of the previous call), decoded_last [B, S] bool (committed at the previous call), pending
  [B, S] bool (`pending_mask` now); shifted: AR-shifted logits (Dream: `dream/model/generation_utils_elastic.py`
  queries the position before each masked one, and those rows feed `track_tokens`). -> (queries [B, S] bool,
  window [B, S] bool: the first window_length pending positions, the ones decoded)."""
  window = pending & (jnp.cumsum(pending.astype(jnp.int32), axis=-1) <= settings.window_length)
  masked_queries = window if settings.block_caching else pending
  if shifted:
    masked_queries = predecessors(masked_queries)
  return tracked | decoded_last | masked_queries, window


def predecessors(mask: jax.Array) -> jax.Array:
  """The position before each one of mask [B, S] bool (position 0 has none): the rows whose AR-shifted logits
  (Dream) predict them. -> [B, S] bool."""
  return jnp.concatenate([mask[:, 1:], jnp.zeros_like(mask[:, :1])], axis=-1)


def commit(settings: ElasticCacheSettings, confidence: jax.Array, window: jax.Array) -> jax.Array:
  """Positions decoded from the window [B, S] bool by their top probability confidence [B, S]: threshold
  rule (>= min(threshold, the window's largest)) or the top tokens_per_iter when threshold is None.
  -> [B, S] bool."""
  confidence = jnp.where(window, confidence.astype(jnp.float32), -jnp.inf)
  if settings.threshold is not None:
    best = jnp.max(confidence, axis=-1, keepdims=True)
    return window & (confidence >= jnp.minimum(settings.threshold, best))
  order = jnp.argsort(-confidence, axis=-1, stable=True)
  rank = jnp.zeros_like(order).at[jnp.arange(order.shape[0])[:, None], order].set(
      jnp.broadcast_to(jnp.arange(order.shape[-1]), order.shape))
  return window & (rank < settings.tokens_per_iter)
