"""The commit rules papers on DLM decoding compare against, as static options and pure per-step functions.

Each rule is a frozen dataclass (its knobs, validated on construction with one-line errors) passed as
`LLaDAOptions.rule`; `dlm_jax.sampling.llada_rules` runs it in the compiled loop. The functions here take
the step's statistics over the generated positions ([B, G] or [B, G, V]) and a candidate mask (the masked
positions of the current block) and return the positions to commit ([B, G] bool). Ties go to the lowest
index first, as everywhere in `dlm_jax.sampling`.

* `EBSampler` — entropy-bounded unmasking (Ben-Hamu et al. 2025, arXiv 2505.24857). Rule as in the
  public code that runs it on LLaDA (NEUIR/PC-Sampler `src/generate.py::generate_with_eb_sampler`): the
  candidates sorted by the entropy H of their predictive distribution, ascending; commit the first k, k the
  number of sorted positions j with (H_1 + … + H_j) − max(H_1..H_j) <= gamma, clamped to [1, #candidates];
  tokens are the argmax. The original runs the whole generation as one block (`block_length = gen_length`)
  until no mask is left; with smaller blocks the rule runs block by block. Research dLLM
  (Kamichanw/d2Cache `confidence_unmasking(gamma=...)`) orders the candidates by confidence instead, takes
  at least the step's quota and is not offered here (see BUILD.md).
* `KLASS` — KL-adaptive stability sampling (Kim et al. 2025; shkim0116/KLASS
  `src/model/llada_klass.py::stable_confident_decode`, alg "klass", unmask_strategy "all"): at every step
  the KL divergence KL(p_t || p_{t−1}) of each position's distribution to the previous step's (the previous
  step of the run, zeros before the first: eps 1e-12 inside both logs) is pushed into a history of length
  h; a masked position of the block is *ready* when it is at least the block's step h − 1, every KL in its
  history is < kl_threshold and its confidence p(x0) > conf_threshold (both strict). Ready positions are
  all committed; when none is, the step's quota (LLaDA's schedule) of most confident candidates is. A block
  takes at most steps / num_blocks steps and ends early once it holds no mask. One deliberate difference:
  when ready tokens ran ahead of the schedule, the original's fallback top-k can ask for more positions than
  the block has masks and then rewrites positions of confidence −inf (the prompt or decoded tokens, which
  ones torch leaves open) with their argmax; we commit at most the masks left. Research dLLM's port drops
  the "step >= h − 1" condition and compares the confidence with >=.
  This is variant "llada_klass", the default on LLaDA and MMaDA. On Dream the default is variant
  "dream_klass", KLASS's Dream code (`src/model/dream_klass.py::_sample`, alg "klass", unmask_strategy
  "all"): the same KL history (zeros before the first step, eps 1e-12, every position every step) over the
  whole generation as one block; *ready* = every KL of the history < kl_threshold and p(x0) >=
  conf_threshold (no step gate: the zero-filled history holds the first step's KL against zeros, which
  is never small, for h calls); all ready positions are committed, else ONE position: the mask with the
  highest `sample_tokens` confidence (temperature, top-p, top-k applied; at temperature > 0 the confidence
  of a sampled token), its token the plain argmax; at most `steps` calls, fewer when no mask is left. Its
  batched loop takes one fallback column for all rows and commits nothing in a row with ready tokens while
  another row has none; we run each row as the original runs it alone (batch-invariant).
* `WINO` — wide-in, narrow-out (Hong et al. 2025; the authors' `decoding_wino`, copied verbatim into
  Research dLLM as `src/generation/wino_official.py`): each call runs the sequence plus a *verification
  copy* of the current block (mask tokens at the block's positions, each seeing everything but its own
  twin position and the other copy positions). Draft: the block's masks with confidence > wide_in
  (strict), at most min(max(⌊0.7·#masks⌋, 5), 20) (the most confident), at least the most confident one.
  Re-mask: when the step drafted more than one token, the block's already-decoded tokens whose
  probability at their copy position is < narrow_out, at most (previous step's draft count − 1) of them
  (the least probable; the count starts at 30 in each block). A block ends when it holds no mask; it needs
  at most block_length calls (each call adds at least one token more than the previous one took back).
  On Dream (no WINO code of the authors' exists for it) the call's S + B outputs are read shifted right by
  one, as Research dLLM's `wino.py` (`prepare_logits_for_generation`): copy position j reads the output at
  S + j − 1 (the sequence's last position for j = 0, copy query j − 1 else); the rule is the same.
* `PCSampler` — position-aware calibration (Huang et al. 2025; NEUIR/PC-Sampler
  `generate_with_pc_sampler`): score = exp(−λ·i) · min(−p(x0)·log(f(x0) + 1e-9), α), i the position in the
  block, f a corpus frequency prior (`dlm_jax.sampling.corpus_prior`); the step's quota of best-scored
  candidates is committed. variant "research_dllm" is Research dLLM's `debias` (no position term,
  epsilon 1e-10).
* `CertaintyPrior` — d2Cache's certainty-prior decoding (Research dLLM `generate_step(sigma=...)`,
  `certainty_density`): score = p(x0) · density, the density a Gaussian (σ) smoothing of the decoded
  indicator over the generated positions, the left boundary counting as decoded and the right one as
  decoded only when the last position is; the step's quota of best-scored candidates is committed.

Every rule runs at temperature 0 as its original (WINO and KLASS's llada_klass take no temperature: refused;
dream_klass samples only its fallback's ranking); PC-Sampler, certainty prior and EB take LLaDA's Gumbel-max
proposals at temperature > 0.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax
import jax.numpy as jnp

from dlm_jax.sampling import corpus_prior
from dlm_jax.sampling.selection import select_top_k

RULE_NAMES = ("eb", "klass", "wino", "pc", "certainty_prior")
"""The `--decoding` names of the rules, in the order of `rule_from_name`."""


def _number(value: Any) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool)


def _probability(name: str, value: Any) -> None:
  if not _number(value) or not 0.0 <= value <= 1.0:
    raise ValueError(f"{name} must be a probability in [0, 1], got {value!r}.")


@dataclasses.dataclass(frozen=True)
class EBSampler:
  """Entropy-bounded unmasking (module docstring). gamma: the entropy budget (>= 0; the published scripts
  use 0.01, Research dLLM's config 0.001)."""

  gamma: float = 0.01

  name = "eb"

  def __post_init__(self):
    if not _number(self.gamma) or not self.gamma >= 0.0:
      raise ValueError(f"eb gamma must be a number >= 0 (an entropy budget in nats), got {self.gamma!r}.")


KLASS_VARIANTS = ("llada_klass", "dream_klass")
"""KLASS's rules, named after the original's files: `llada_klass.py` (LLaDA, MMaDA; Dream by choice) and
`dream_klass.py` (Dream only)."""


@dataclasses.dataclass(frozen=True)
class KLASS:
  """KL-adaptive stability sampling (module docstring): conf_threshold (original default 0.9),
  kl_threshold (> 0, default 0.01), kl_history_length (>= 1, default 2); variant: None (the code of the
  family it runs on: "llada_klass" on LLaDA / MMaDA, "dream_klass" on Dream) or a `KLASS_VARIANTS` name."""

  conf_threshold: float = 0.9
  kl_threshold: float = 0.01
  kl_history_length: int = 2
  variant: Literal["llada_klass", "dream_klass"] | None = None

  name = "klass"

  def __post_init__(self):
    _probability("klass conf_threshold", self.conf_threshold)
    if not _number(self.kl_threshold) or not self.kl_threshold > 0.0:
      raise ValueError(f"klass kl_threshold must be a number > 0, got {self.kl_threshold!r}.")
    if isinstance(self.kl_history_length, bool) or not isinstance(self.kl_history_length, int) \
        or self.kl_history_length < 1:
      raise ValueError(f"klass kl_history_length must be an integer >= 1, got {self.kl_history_length!r}.")
    if self.variant is not None and self.variant not in KLASS_VARIANTS:
      raise ValueError(f"klass variant must be one of {', '.join(KLASS_VARIANTS)} (unset: the family's own), got "
                       f"{self.variant!r}.")

  def variant_on(self, dream: bool) -> str:
    """The variant that runs: the one set, else the family's own ("dream_klass" on Dream)."""
    return self.variant or ("dream_klass" if dream else "llada_klass")


@dataclasses.dataclass(frozen=True)
class WINO:
  """Wide-in, narrow-out (module docstring): wide_in (draft bar, default 0.7 as the authors' script and
  Research dLLM's `wino_official`) <= narrow_out (keep bar, default 0.9)."""

  wide_in: float = 0.7
  narrow_out: float = 0.9

  name = "wino"

  def __post_init__(self):
    _probability("wino wide_in", self.wide_in)
    _probability("wino narrow_out", self.narrow_out)


PC_VARIANTS = ("pc_sampler", "research_dllm")


@dataclasses.dataclass(frozen=True, eq=False)
class PCSampler:
  """PC-Sampler (module docstring). prior: a `corpus_prior.CorpusPrior` (required); lam: the position
  decay λ >= 0 (default 0.25, the published scripts'); alpha: the clip α > 0 (default 10); variant:
  "pc_sampler" (the original) or "research_dllm" (no position term, epsilon 1e-10). Equal and hashed by
  knobs and the prior's digest, so it can sit in static options."""

  prior: Any = None
  lam: float = 0.25
  alpha: float = 10.0
  variant: Literal["pc_sampler", "research_dllm"] = "pc_sampler"

  name = "pc"

  def __post_init__(self):
    if self.prior is None:
      raise ValueError("pc needs a corpus prior (`--pc_prior=<file>`, see dlm_jax.sampling.corpus_prior).")
    if not _number(self.lam) or not self.lam >= 0.0:
      raise ValueError(f"pc lam must be a number >= 0 (a position decay), got {self.lam!r}.")
    if not _number(self.alpha) or not self.alpha > 0.0:
      raise ValueError(f"pc alpha must be a number > 0 (a clip), got {self.alpha!r}.")
    if self.variant not in PC_VARIANTS:
      raise ValueError(f"pc variant must be one of {', '.join(PC_VARIANTS)}, got {self.variant!r}.")

  def _key(self):
    return (self.prior.digest, self.lam, self.alpha, self.variant)

  def __eq__(self, other):
    return isinstance(other, PCSampler) and self._key() == other._key()

  def __hash__(self):
    return hash(self._key())


@dataclasses.dataclass(frozen=True)
class CertaintyPrior:
  """d2Cache's certainty prior (module docstring): sigma > 0, the Gaussian's standard deviation in positions
  (default 10, d2Cache's `gen_args`)."""

  sigma: float = 10.0

  name = "certainty_prior"

  def __post_init__(self):
    if not _number(self.sigma) or not self.sigma > 0.0:
      raise ValueError(f"certainty_prior sigma must be a number > 0, got {self.sigma!r}.")


Rule = EBSampler | KLASS | WINO | PCSampler | CertaintyPrior


# ------------------------------------------------------------------------------------------ rules


def entropy(logits: jax.Array) -> jax.Array:
  """Entropy (nats) of softmax(logits) over the last axis, at least float32. [..., V] -> [...]."""
  logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
  log_p = jax.nn.log_softmax(logits, axis=-1)
  return -jnp.sum(jnp.exp(log_p) * log_p, axis=-1)


def eb_transfer(entropies: jax.Array, candidates: jax.Array, gamma: float) -> jax.Array:
  """EB-Sampler: the candidates in ascending entropy order, the first k with k = #{j : Σ_{i<=j} H_i −
  max_{i<=j} H_i <= gamma}, at least 1 (when there is a candidate). [B, G] -> [B, G] bool."""
  key = jnp.where(candidates, entropies, jnp.inf)
  order = jnp.argsort(key, axis=-1, stable=True)
  ordered = jnp.take_along_axis(jnp.where(candidates, entropies, 0.0), order, axis=-1)
  ordered_candidates = jnp.take_along_axis(candidates, order, axis=-1)
  excess = jnp.cumsum(ordered, axis=-1) - jax.lax.cummax(ordered, axis=ordered.ndim - 1)
  n = jnp.sum(candidates, axis=-1)
  k = jnp.clip(jnp.sum((excess <= gamma) & ordered_candidates, axis=-1), jnp.minimum(n, 1), n)
  return select_top_k(-key, k) & candidates


def kl_divergence(p: jax.Array, p_prev: jax.Array, eps: float = 1e-12) -> jax.Array:
  """KLASS's Σ_v p (log(p + eps) − log(p_prev + eps)). [..., V] -> [...]."""
  return jnp.sum(p * (jnp.log(p + eps) - jnp.log(p_prev + eps)), axis=-1)


def klass_transfer(confidence: jax.Array, history: jax.Array, candidates: jax.Array, block_step: jax.Array,
                   quota: jax.Array, rule: KLASS, ranking: jax.Array | None = None) -> jax.Array:
  """KLASS's choice: the ready candidates (module docstring) when a row has one, else its quota of most
  confident candidates. confidence [B, G], history [B, G, h] (newest last), candidates [B, G], block_step
  scalar, quota [B]; ranking [B, G]: the fallback's confidence when it is another than the gate's (Dream's
  KLASS ranks by p(x0) after top-p / top-k, its `sample_tokens`), default confidence -> [B, G] bool."""
  stable = jnp.all(history < rule.kl_threshold, axis=-1) & (block_step >= rule.kl_history_length - 1)
  ready = stable & (confidence > rule.conf_threshold) & candidates
  scores = jnp.where(candidates, confidence if ranking is None else ranking, -jnp.inf)
  fallback = select_top_k(scores, jnp.minimum(quota, jnp.sum(candidates, axis=-1))) & candidates
  return jnp.where(jnp.any(ready, axis=-1, keepdims=True), ready, fallback)


def dream_klass_transfer(confidence: jax.Array, history: jax.Array, candidates: jax.Array, ranking: jax.Array,
                         rule: KLASS) -> jax.Array:
  """KLASS's Dream code (variant "dream_klass", module docstring): the candidates whose history [B, G, h] is
  all < kl_threshold and whose confidence [B, G] is >= conf_threshold when a row has one, else its one
  candidate of highest ranking [B, G] (`sample_tokens`' confidence; the lowest index among equals, as
  torch.argmax). -> [B, G] bool."""
  stable = jnp.all(history < rule.kl_threshold, axis=-1)
  ready = stable & (confidence >= rule.conf_threshold) & candidates
  best = select_top_k(jnp.where(candidates, ranking, -jnp.inf), jnp.minimum(jnp.sum(candidates, axis=-1), 1))
  return jnp.where(jnp.any(ready, axis=-1, keepdims=True), ready, best & candidates)


def wino_draft(confidence: jax.Array, candidates: jax.Array, wide_in: float) -> jax.Array:
  """WINO's wide-in draft: candidates with confidence > wide_in, capped at min(max(⌊0.7·n⌋, 5), 20) of the
  most confident (n the row's candidates), at least the most confident one. [B, G] -> [B, G] bool."""
  scores = jnp.where(candidates, confidence, -jnp.inf)
  above = candidates & (scores > wide_in)
  n = jnp.sum(candidates, axis=-1)
  cap = jnp.minimum(jnp.maximum((7 * n) // 10, 5), 20)
  count = jnp.sum(above, axis=-1)
  capped = select_top_k(scores, cap) & candidates
  best = select_top_k(scores, jnp.minimum(n, 1)) & candidates
  chosen = jnp.where((count > cap)[:, None], capped, above)
  return jnp.where((count == 0)[:, None], best, chosen)


def wino_remask(back_confidence: jax.Array, decoded: jax.Array, drafted: jax.Array, last_drafted: jax.Array,
                narrow_out: float) -> jax.Array:
  """WINO's narrow-out: when the step drafted more than one token, the decoded block tokens whose copy-position
  probability is < narrow_out; when there are at least `last_drafted` of them, only the last_drafted − 1
  least probable. back_confidence, decoded [B, G]; drafted, last_drafted [B] int -> [B, G] bool."""
  below = decoded & (back_confidence < narrow_out)
  scores = jnp.where(decoded, -back_confidence, -jnp.inf)
  count = jnp.sum(below, axis=-1)
  fewest = select_top_k(scores, jnp.maximum(last_drafted - 1, 0)) & decoded
  remask = jnp.where((count >= last_drafted)[:, None], fewest, below)
  return remask & (drafted > 1)[:, None]


def pc_scores(confidence: jax.Array, x0: jax.Array, frequencies: jax.Array, block_start: jax.Array,
              rule: PCSampler) -> jax.Array:
  """PC-Sampler's score on the generated positions: exp(−λ·(g − block_start)) · min(−p·log(f(x0) + eps), α)
  (no position term and eps 1e-10 for variant "research_dllm"). confidence, x0 [B, G]; frequencies [V]."""
  eps = 1e-9 if rule.variant == "pc_sampler" else 1e-10
  calibrated = jnp.minimum(-confidence * jnp.log(frequencies[x0] + eps), rule.alpha)
  if rule.variant == "research_dllm":
    return calibrated
  position = (jnp.arange(confidence.shape[-1]) - block_start).astype(jnp.float32)
  return jnp.exp(-rule.lam * position)[None, :] * calibrated


def certainty_density(decoded: jax.Array, sigma: float) -> jax.Array:
  """d2Cache's certainty density of decoded [B, G] bool (module docstring): for position i,
  Σ_j e(j) k(i − j) / Σ_{d=−3G}^{3G−1} k(d) over the extended indicator e = [1]*G ⊕ decoded ⊕ [decoded[−1]]*G,
  k(d) = exp(−d² / 2σ²). Computed directly (the original uses an FFT; the same sums). -> [B, G] float32."""
  g = decoded.shape[-1]
  right = jnp.broadcast_to(decoded[:, -1:], decoded.shape)
  extended = jnp.concatenate([jnp.ones_like(decoded), decoded, right], axis=-1).astype(jnp.float32)
  distance = (jnp.arange(g)[:, None] + g - jnp.arange(3 * g)[None, :]).astype(jnp.float32)
  kernel = jnp.exp(-distance ** 2 / (2.0 * sigma ** 2))
  offsets = jnp.arange(-3 * g, 3 * g).astype(jnp.float32)
  total = jnp.maximum(jnp.sum(jnp.exp(-offsets ** 2 / (2.0 * sigma ** 2))), 1e-8)
  return jnp.sum(extended[:, None, :] * kernel[None], axis=-1) / total


def check_llada_options(options) -> None:
  """Refuses, in one line, `LLaDAOptions` a rule cannot run with (called by its __post_init__)."""
  rule = options.rule
  if not isinstance(rule, (EBSampler, KLASS, WINO, PCSampler, CertaintyPrior)):
    raise ValueError(f"rule must be one of EBSampler, KLASS, WINO, PCSampler, CertaintyPrior or None, got {rule!r}.")
  if isinstance(rule, KLASS) and rule.variant == "dream_klass":
    raise ValueError("klass variant 'dream_klass' is KLASS's Dream code and runs on Dream only; LLaDA and MMaDA run "
                     "'llada_klass' (leave variant unset).")
  _check_wino_cache(rule, options.cache)
  clashes = {"threshold": options.threshold is not None, "factor": options.factor is not None,
             "cfg_scale": options.cfg_scale > 0 and isinstance(rule, WINO),
             "remasking='random'": options.remasking != "low_confidence",
             "stop_token_id": options.stop_token_id is not None,
             "temperature > 0": options.temperature > 0 and isinstance(rule, (KLASS, WINO)),
             # KLASS and WINO commit the plain argmax and EB bounds the plain logits' entropy: LLaDA's EOS knobs
             # would change only part of their rule
             "logits_eos_inf": options.logits_eos_inf and isinstance(rule, (KLASS, WINO, EBSampler)),
             "confidence_eos_eot_inf": options.confidence_eos_eot_inf and isinstance(rule, (KLASS, WINO, EBSampler))}
  for name, clash in clashes.items():
    if clash:
      raise ValueError(f"decoding rule {rule.name} cannot be combined with {name}; it runs without it in its "
                       "original code.")
  if options.dual_cache_forwards != "until_done":
    raise ValueError(f"decoding rule {rule.name} bounds a block's calls itself; dual_cache_forwards="
                     f"{options.dual_cache_forwards!r} applies to the quota, threshold and factor rules only.")
  if isinstance(rule, (PCSampler, CertaintyPrior, KLASS)) and options.steps_per_block > options.block:
    raise ValueError(f"decoding rule {rule.name} takes at most block_length steps per block; got steps / "
                     f"num_blocks = {options.steps_per_block} > block_length = {options.block}.")


def _check_wino_cache(rule: Rule, cache: str) -> None:
  """WINO has no cached form: its verification copy checks decoded tokens against the current block, which a
  cached call does not recompute, and Research dLLM runs its calls without its cache (use_cache=False)."""
  if isinstance(rule, WINO) and cache != "none":
    raise ValueError(f"decoding rule wino does not run with cache={cache!r}: its verification copy must read the "
                     "block as decoded now (the authors' code has no cache, Research dLLM runs wino without its "
                     "cache); use cache='none'.")


KNOBS: dict[str, tuple[str, ...]] = {
    "eb": ("gamma",), "klass": ("conf_threshold", "kl_threshold", "kl_history_length", "variant"),
    "wino": ("wide_in", "narrow_out"), "pc": ("prior", "lam", "alpha", "variant"), "certainty_prior": ("sigma",)}
"""Each rule's knobs by `RULE_NAMES` name (the dataclass fields)."""


def rule_from_name(name: str, **knobs: Any) -> Rule:
  """The rule called `name` (`RULE_NAMES`) with these knobs (others at their defaults); for "pc" `prior` is a
  `corpus_prior.CorpusPrior` or a prior file's path (loaded and checked). One-line ValueError on a bad name,
  an unknown knob or a bad value."""
  classes = {"eb": EBSampler, "klass": KLASS, "wino": WINO, "pc": PCSampler, "certainty_prior": CertaintyPrior}
  if name not in classes:
    raise ValueError(f"decoding rule must be one of {', '.join(RULE_NAMES)}, got {name!r}.")
  unknown = sorted(set(knobs) - set(KNOBS[name]))
  if unknown:
    raise ValueError(f"decoding rule {name} has no knob {', '.join(unknown)}; its knobs: {', '.join(KNOBS[name])}.")
  if name == "pc" and isinstance(knobs.get("prior"), str):
    knobs = dict(knobs, prior=corpus_prior.load(knobs["prior"]))
  return classes[name](**knobs)


def check_dream_options(options) -> None:
  """Refuses, in one line, `DreamOptions` a rule cannot run with (called by its __post_init__): threshold,
  factor, WINO with a cache, WINO and KLASS's llada_klass at temperature > 0, EB and WINO with top-p / top-k
  (EB's entropy and WINO's bars read the unfiltered distribution; KLASS ranks its fallback by the filtered
  p(x0) as its Dream code, PC-Sampler and the certainty prior read the filtered p(x0) as Research dLLM),
  alg_temp; blocks must divide gen_length and steps fit the blocks; KLASS's dream_klass takes no blocks and
  no cache (`_check_dream_klass`)."""
  rule = options.rule
  if not isinstance(rule, (EBSampler, KLASS, WINO, PCSampler, CertaintyPrior)):
    raise ValueError(f"rule must be one of EBSampler, KLASS, WINO, PCSampler, CertaintyPrior or None, got {rule!r}.")
  _check_wino_cache(rule, options.cache)
  dream_klass = isinstance(rule, KLASS) and rule.variant_on(dream=True) == "dream_klass"
  if dream_klass:
    _check_dream_klass(options)
  filtered = (options.top_p is not None and options.top_p < 1) or options.top_k is not None
  clashes = {"threshold": options.threshold is not None, "factor": options.factor is not None,
             "alg_temp": bool(options.alg_temp),
             "temperature > 0": options.temperature > 0 and isinstance(rule, (KLASS, WINO)) and not dream_klass,
             "top_p or top_k": isinstance(rule, (WINO, EBSampler)) and filtered}
  for name, clash in clashes.items():
    if clash:
      raise ValueError(f"decoding rule {rule.name} cannot be combined with {name}; it runs without it in its "
                       "original code.")
  if isinstance(options.block_length, bool) or (options.block_length is not None and (
      not isinstance(options.block_length, int) or options.block_length <= 0
      or options.gen_length % options.block_length)):
    raise ValueError(f"block_length must be a positive divisor of gen_length ({options.gen_length}) or None, got "
                     f"{options.block_length!r}.")
  if options.steps % options.num_blocks:
    raise ValueError(f"steps ({options.steps}) must be a multiple of the number of blocks gen_length / "
                     f"block_length = {options.num_blocks}.")
  if isinstance(rule, (PCSampler, CertaintyPrior, KLASS)) and not dream_klass \
      and options.steps_per_block > options.block:
    raise ValueError(f"decoding rule {rule.name} takes at most block_length steps per block; got steps / "
                     f"num_blocks = {options.steps_per_block} > block_length = {options.block}.")


def _check_dream_klass(options) -> None:
  """KLASS's Dream code decodes the whole generation as one block with no cache (its loop calls the model on the
  whole sequence): another block length or a cache is refused, naming the variant that has them."""
  if options.block_length not in (None, options.gen_length):
    raise ValueError(f"klass variant 'dream_klass' (KLASS's Dream code) decodes the whole generation as one block; "
                     f"got block_length={options.block_length!r}: leave it unset, or set variant='llada_klass' for "
                     "blocks.")
  if options.cache != "none":
    raise ValueError(f"klass variant 'dream_klass' has no blocks, so a cache would be refreshed at its first call "
                     f"only; got cache={options.cache!r}: use cache='none', or variant='llada_klass' with blocks.")
