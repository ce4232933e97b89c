"""The decoding modes of a decoding session (the binaries' --decoding, --threshold, --factor; lm-eval's
model_args of the same names) and how a mode becomes sampler options: exact decoding, or Fast-dLLM's
parallel decoding and approximate KV caches (`reference/decoding_modes.md` §2–§5; the library side is
`dlm_jax.sampling.llada_blockwise`).

  mode (--decoding)       transfer rule at a step (in the current block)      model calls of a block
  exact                   the sampler's own (LLaDA: a quota of steps/blocks)  the whole sequence at every step
  threshold               confidence >= --threshold, at least the best one    the whole sequence at every step
  factor                  Fast-dLLM's factor rule with --factor (NVlabs')     the whole sequence at every step
  factor_dllm             the factor rule as dllm vectorises it               the whole sequence at every step
  factor_research_dllm    Research dLLM's factor rule (d2Cache's runs)        the whole sequence at every step
  prefix_cache            the quota rule                                      refresh, then queries [s, S)
  dual_cache              the quota rule                                      refresh, then the block's queries
  threshold_prefix_cache  the threshold rule                                  as prefix_cache
  threshold_dual_cache    the threshold rule                                  as dual_cache

A block [s, e) under a cache starts with a refresh (a whole-sequence step that also fills the cache); the
prefix cache then computes the queries [s, S) over the cached keys of [0, s) and their own, the dual cache
only the block's queries over all S cached keys, the block's written in place. With the threshold or
factor rule a block takes as many steps as it needs (one token at least per step, so `--steps` only has
to be a multiple of the number of blocks) and a row of a batch whose block is done waits for the others.
Defaults: --threshold 0.9 and --factor 1.0, Fast-dLLM's values.

Variants of the originals (`reference/decoding_modes.md` §3, §5). `factor` is the rule of NVlabs' code (its
loop stops at the first failing rank and commits every candidate when only the last one fails);
`factor_dllm` is dllm's vectorised rule (exactly the accepted prefix). --dual_cache_forwards chooses how many
model calls a block may take under the dual cache: `until_done` (default; NVlabs' June-2025 code, 24cc59e:
until the block holds no mask) or `steps_per_block` (NVlabs' current code: at most --steps / blocks calls,
the refresh included; masks a block leaves compete at later blocks' refreshes and the output can end with
mask ids); LLaDA and MMaDA only.

Compute policies (--policy; `dlm_jax.policy`) run with exact, threshold, factor and factor_dllm decoding and the
decoding rules but wino, not with the cache modes (the policy keeps its own KV cache and chooses each call's
queries; docs/guides/compute_policies.md, "Decoding modes and Dream") — but sparse_dllm, which composes with the
prefix and dual caches (its kept keys are a subset of the cached ones; "Sparse-dLLM with the Fast-dLLM caches")
and, with --sampler=block_diffusion, with block diffusion's exact cache (the sampler refuses the other policies).

Elastic-Cache's decoding (`llada.elastic_cache_options()`, `dream.elastic_cache_options()`): --window=N and
--eos_truncation with a threshold or factor mode without a cache (LLaDA, MMaDA and Dream): a call's candidates are
the block's first N masks (with --block_length equal to --gen_length: the official sliding window over the
generation; Dream always decodes the whole generation as one window, without blocks, as the official Dream loop:
`DecodingMode.whole_generation`), and after the first call that decodes the EOS id the masks after it are never
decoded. Recorded as "window" / "eos_truncation".

Decoding rules. eb, klass, wino, pc and certainty_prior run the rules of `dlm_jax.sampling.decoding_rules`
(EB-Sampler, KLASS, WINO, PC-Sampler, d2Cache's certainty prior) with their knobs (`experiments.common.decoding_flags`:
--eb_gamma, --klass_*, --wino_*, --pc_prior / --pc_lambda / --pc_alpha / --pc_variant, --certainty_sigma;
recorded as "knobs"); LLaDA, MMaDA and Dream. KLASS on Dream runs KLASS's Dream code by default (--klass_variant
unset or dream_klass: the whole generation as one block, so no --block_length default is applied; no cache) and
LLaDA's rule with --klass_variant=llada_klass. --cache=prefix|dual gives eb, klass, pc and certainty_prior a KV
cache (recorded as "cache"; `dlm_jax.sampling.llada_rules`; wino refuses one); the other modes name theirs.

Samplers. `dlm_jax.sampling.registry` lists the option fields of each sampler's options that the modes set
(`Sampler.mode_fields`): LLaDA
and MMaDA take every mode (`LLaDAOptions.threshold / factor / cache`), Dream too (`DreamOptions`, with
the binaries' block length; its quota caches need --alg other than origin, which reveals at random). The
autoregressive
sampler already decodes with an exact KV cache, one token per call: the modes do not apply to it (the
binaries warn and decode it as usual, `experiments.common.decoding.warn_if_unused`). Block diffusion (LLaDA2.x,
block-causal models) always decodes with
its exact KV cache: exact is LLaDA2's own rule, threshold Fast-dLLM's; the cache and factor modes are
refused. The DiffusionGemma sampler (uniform-state models) has its own acceptance rule (entropy bound) and
an exact prompt cache: like the autoregressive one it is decoded as usual, with a warning.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from dlm_jax.sampling import corpus_prior, decoding_rules, registry
from dlm_jax.policy.base import ComputePolicy
from dlm_jax.policy.registry import parse_policy
from dlm_jax.sampling.blocks import CACHE_POLICIES
from dlm_jax.session.errors import CombinationError, SessionError

MODES: dict[str, tuple[str, str]] = {
    "exact": ("quota", "none"),
    "threshold": ("threshold", "none"),
    "factor": ("factor", "none"),
    "factor_dllm": ("factor", "none"),
    "factor_research_dllm": ("factor", "none"),
    "prefix_cache": ("quota", "prefix"),
    "dual_cache": ("quota", "dual"),
    "threshold_prefix_cache": ("threshold", "prefix"),
    "threshold_dual_cache": ("threshold", "dual"),
}
"""--decoding name -> (transfer rule: quota | threshold | factor, cache: none | prefix | dual)."""

RULE_MODES: dict[str, tuple[str, str]] = {name: (name, "none") for name in decoding_rules.RULE_NAMES}
"""The decoding-rule modes (`dlm_jax.sampling.decoding_rules`), same layout as `MODES`; no cache."""

ALL_MODES: dict[str, tuple[str, str]] = {**MODES, **RULE_MODES}
"""Every --decoding name."""

RULE_ARGS: dict[str, tuple[str, str]] = {
    "eb_gamma": ("eb", "gamma"), "klass_conf_threshold": ("klass", "conf_threshold"),
    "klass_kl_threshold": ("klass", "kl_threshold"), "klass_kl_history_length": ("klass", "kl_history_length"),
    "klass_variant": ("klass", "variant"),
    "wino_wide_in": ("wino", "wide_in"), "wino_narrow_out": ("wino", "narrow_out"), "pc_prior": ("pc", "prior"),
    "pc_lambda": ("pc", "lam"), "pc_alpha": ("pc", "alpha"), "pc_variant": ("pc", "variant"),
    "certainty_sigma": ("certainty_prior", "sigma")}
"""The flat names of the rules' knobs (binary flags, lm-eval model_args) -> (rule, knob)."""


def rule_knobs(decoding: str, values: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
  """The knobs of rule `decoding` among flat-named `values` (`RULE_ARGS`), as sorted (knob, value) pairs; an unset
  value (None: --pc_prior, --klass_variant) is left out, so the rule's default applies."""
  return tuple(sorted((knob, values[flat]) for flat, (rule, knob) in RULE_ARGS.items()
                      if rule == decoding and values.get(flat) is not None))


RULE_CACHES = ("none", "prefix", "dual")
"""--cache values of the decoding rules (`DecodingMode.rule_cache`)."""

DEFAULT_THRESHOLD = 0.9
DEFAULT_FACTOR = 1.0
DUAL_CACHE_FORWARDS = ("until_done", "steps_per_block")
"""--dual_cache_forwards values (module docstring); the first is the default."""

@dataclasses.dataclass(frozen=True)
class DecodingMode:
  """One decoding mode (recorded with the results; build it with `from_values` or `from_spec`).

  decoding: an `ALL_MODES` name; threshold: τ of the threshold rule, only when the mode uses it (else None);
  factor: f of the factor rule, likewise; dual_cache_forwards: a `DUAL_CACHE_FORWARDS` value (not the
  default only with the dual cache); knobs: the decoding rule's knobs as sorted (name, value) pairs (the rule
  modes eb, klass, wino, pc, certainty_prior; `dlm_jax.sampling.decoding_rules`; pc's "prior" is the prior
  file's path); policy: the compute policy as `dlm_jax.policy.registry.parse_policy` reads it ("none": compute
  everything), recorded only when it is not "none" (so records written before policies resume unchanged);
  rule_cache: a decoding rule's KV cache (none, prefix or dual; --cache), recorded only when it is not "none";
  window, eos_truncation: Elastic-Cache's decoding (--window, --eos_truncation; `LLaDAOptions.window` /
  `eos_truncation`): a call's candidates are the first `window` masks of the block, and after the first call that
  decodes the EOS id the masks after it are never decoded; threshold and factor modes without a cache, LLaDA,
  MMaDA and Dream (`DreamOptions.window` / `eos_truncation`, no blocks); recorded only when set.
  """

  decoding: str = "exact"
  threshold: float | None = None
  factor: float | None = None
  dual_cache_forwards: str = DUAL_CACHE_FORWARDS[0]
  knobs: tuple[tuple[str, Any], ...] = ()
  policy: str = "none"
  rule_cache: str = "none"
  window: int | None = None
  eos_truncation: bool = False

  def __post_init__(self):
    if self.decoding not in ALL_MODES:
      raise SessionError(f"--decoding={self.decoding}: expected one of {', '.join(ALL_MODES)}")
    _check_threshold(self.threshold)
    _check_factor(self.factor)
    for name, used in (("threshold", self.rule == "threshold"), ("factor", self.rule == "factor")):
      if (getattr(self, name) is not None) != used:
        raise SessionError(f"--decoding={self.decoding} {'needs' if used else 'takes no'} a {name} value")
    if self.dual_cache_forwards not in DUAL_CACHE_FORWARDS:
      raise SessionError(f"--dual_cache_forwards={self.dual_cache_forwards}: expected one of "
                         f"{', '.join(DUAL_CACHE_FORWARDS)}")
    if self.dual_cache_forwards != DUAL_CACHE_FORWARDS[0] and self.cache != "dual":
      raise SessionError(f"--dual_cache_forwards={self.dual_cache_forwards} applies to the dual-cache modes "
                         f"(dual_cache, threshold_dual_cache), not --decoding={self.decoding}")
    if self.knobs and self.rule not in decoding_rules.RULE_NAMES:
      raise SessionError(f"--decoding={self.decoding} takes no rule knobs ({', '.join(k for k, _ in self.knobs)})")
    if self.rule_cache not in RULE_CACHES:
      raise SessionError(f"--cache={self.rule_cache}: expected one of {', '.join(RULE_CACHES)}")
    if self.rule_cache != "none" and self.rule not in decoding_rules.RULE_NAMES:
      raise SessionError(f"--cache={self.rule_cache} applies to the decoding rules; --decoding={self.decoding} names "
                         "its cache itself (prefix_cache, dual_cache, threshold_*_cache)")
    if self.rule in decoding_rules.RULE_NAMES:
      self.decoding_rule()
      if self.rule_cache != "none" and self.decoding == "wino":
        raise CombinationError(f"--decoding=wino does not run with --cache={self.rule_cache}: its verification copy "
                               "must read the block as decoded now; use --cache=none")
    if self.rule in decoding_rules.RULE_NAMES and self.dual_cache_forwards != DUAL_CACHE_FORWARDS[0]:
      raise SessionError(f"--dual_cache_forwards={self.dual_cache_forwards} applies to the dual-cache modes "
                         f"(dual_cache, threshold_dual_cache), not --decoding={self.decoding}")
    self._check_elastic_decoding()
    self.compute_policy()
    if self.policy != "none" and self.rule_cache != "none":
      raise CombinationError(f"--policy={self.policy} does not run with --decoding={self.decoding} and --cache="
                             f"{self.rule_cache} (the rule's cached calls are its own); use --cache=none")
    if self.policy != "none" and self.cache != "none" and self.compute_policy().NAME not in CACHE_POLICIES:
      raise CombinationError(f"--policy={self.policy} does not compose with --decoding={self.decoding}: the policy "
                             "chooses what each call computes over all S positions, which the cache's fixed query "
                             "window does not leave it; use a mode without a cache (exact, threshold, a factor "
                             f"mode or a decoding rule; the cache modes take {', '.join(CACHE_POLICIES)})")
    if self.policy != "none" and self.cache == "dual" and self.dual_cache_forwards != DUAL_CACHE_FORWARDS[0]:
      raise CombinationError(f"--policy={self.policy} does not run with --dual_cache_forwards="
                             f"{self.dual_cache_forwards}; use {DUAL_CACHE_FORWARDS[0]}")
    if self.policy != "none" and self.decoding == "wino":
      raise CombinationError(f"--policy={self.policy} does not run with --decoding=wino (its calls append a "
                             "verification copy of the block and it re-masks decoded tokens); use eb, klass, pc or "
                             "certainty_prior")

  def _check_elastic_decoding(self) -> None:
    """--window and --eos_truncation: their values, and a threshold or factor mode without a cache."""
    if self.window is not None and (isinstance(self.window, bool) or not isinstance(self.window, int)
                                    or self.window < 1):
      raise SessionError(f"--window={self.window}: expected a positive integer (unset: the whole block)")
    if not isinstance(self.eos_truncation, bool):
      raise SessionError(f"--eos_truncation={self.eos_truncation}: expected true or false")
    if (self.window is not None or self.eos_truncation) and (self.rule not in ("threshold", "factor")
                                                             or self.cache != "none"):
      name = "--window" if self.window is not None else "--eos_truncation"
      raise CombinationError(f"{name} (Elastic-Cache's decoding) runs with --decoding=threshold or a factor mode "
                             f"without a cache, not --decoding={self.decoding}")

  def compute_policy(self) -> ComputePolicy:
    """The compute policy (`dlm_jax.policy`); a one-line error on a bad name or knob."""
    try:
      return parse_policy(self.policy)
    except ValueError as e:
      raise SessionError(f"--policy={self.policy}: {e}") from None

  def decoding_rule(self) -> decoding_rules.Rule:
    """The rule of a rule mode (the pc prior loaded from its file); a one-line error on a bad knob."""
    try:
      return decoding_rules.rule_from_name(self.decoding, **dict(self.knobs))
    except ValueError as e:
      raise SessionError(f"--decoding={self.decoding}: {e}") from None

  def whole_generation(self, sampler: str) -> bool:
    """Whether the mode decodes `sampler`'s whole generation as one block: KLASS's Dream code (--decoding=klass on
    the dream sampler, variant unset or dream_klass) and Elastic-Cache's Dream decoding (--window or
    --eos_truncation on the dream sampler), which have no blocks; the block length stays unset."""
    if sampler == "dream" and (self.window is not None or self.eos_truncation):
      return True
    return self.decoding == "klass" and sampler == "dream" and self.decoding_rule().variant_on(dream=True) == \
        "dream_klass"

  @property
  def factor_rule(self) -> str:
    """The factor rule's variant (`dlm_jax.sampling.parallel.FACTOR_RULES`): dllm's for factor_dllm, Research
    dLLM's for factor_research_dllm, else NVlabs'."""
    return {"factor_dllm": "dllm", "factor_research_dllm": "research_dllm"}.get(self.decoding, "fast_dllm")

  @property
  def rule(self) -> str:
    """The transfer rule: quota (the sampler's own), threshold or factor."""
    return ALL_MODES[self.decoding][0]

  @property
  def cache(self) -> str:
    """none, prefix or dual (a decoding rule's: --cache)."""
    return self.rule_cache if self.rule in decoding_rules.RULE_NAMES else ALL_MODES[self.decoding][1]

  @property
  def exact(self) -> bool:
    return self.decoding == "exact"

  @property
  def spec(self) -> str:
    """The mode as `from_spec` reads it: its name, or its name, a colon and the rule's parameter (a decoding
    rule's cache: `name:cache=dual`; its knobs are in `record()`)."""
    value = self.threshold if self.threshold is not None else self.factor
    if self.rule_cache != "none":
      return f"{self.decoding}:cache={self.rule_cache}"
    return self.decoding if value is None else f"{self.decoding}:{value:g}"

  def record(self) -> dict[str, Any]:
    """{"decoding": name} plus the rule's parameter ("threshold" or "factor") when the mode has one."""
    values: dict[str, Any] = {"decoding": self.decoding}
    if self.threshold is not None:
      values["threshold"] = self.threshold
    if self.factor is not None:
      values["factor"] = self.factor
    if self.dual_cache_forwards != DUAL_CACHE_FORWARDS[0]:
      values["dual_cache_forwards"] = self.dual_cache_forwards
    if self.knobs:
      values["knobs"] = dict(self.knobs)
    if self.policy != "none":
      values["policy"] = self.policy
    if self.rule_cache != "none":
      values["cache"] = self.rule_cache
    if self.window is not None:
      values["window"] = self.window
    if self.eos_truncation:
      values["eos_truncation"] = True
    return values

  @classmethod
  def from_record(cls, values: dict[str, Any]) -> DecodingMode:
    """The mode of a `record()` (missing "decoding" = exact; other keys of `values` are ignored)."""
    return cls(values.get("decoding", "exact"), values.get("threshold"), values.get("factor"),
               values.get("dual_cache_forwards", DUAL_CACHE_FORWARDS[0]),
               tuple(sorted(values.get("knobs", {}).items())), values.get("policy", "none"),
               values.get("cache", "none"), values.get("window"), values.get("eos_truncation", False))

  def option_fields(self, sampler: str) -> dict[str, Any]:
    """The fields of `sampler`'s options that this mode sets (every field the sampler has; {} for a sampler
    without modes, `registry.Sampler.mode_fields`).

    Raises a one-line error when the mode needs a field the sampler does not have (Dream, for now).
    """
    supported = registry.get(sampler).mode_fields
    if not supported:
      return {}
    if self.rule in decoding_rules.RULE_NAMES:
      if "rule" not in supported:
        raise CombinationError(f"--decoding={self.decoding}: the {sampler} sampler has no {self.decoding} decoding "
                               "yet; use --decoding=exact, threshold or factor")
      if self.rule_cache != "none" and "cache" not in supported:
        raise CombinationError(f"--decoding={self.decoding} --cache={self.rule_cache}: the {sampler} sampler has no "
                               "cache; use --cache=none")
      fields = {"rule": self.decoding_rule()}
      return fields if self.rule_cache == "none" else dict(fields, cache=self.rule_cache)
    if "transfer" in supported:
      return self._transfer_fields(sampler)
    fields = {"threshold": self.threshold, "factor": self.factor, "cache": self.cache}
    if self.factor_rule != "fast_dllm" and self.rule == "factor":
      fields["factor_rule"] = self.factor_rule
    if self.dual_cache_forwards != DUAL_CACHE_FORWARDS[0]:
      fields["dual_cache_forwards"] = self.dual_cache_forwards
    if self.window is not None:
      fields["window"] = self.window
    if self.eos_truncation:
      fields["eos_truncation"] = True
    missing = sorted(k for k, v in fields.items() if v not in (None, "none") and k not in supported)
    if missing:
      raise CombinationError(f"--decoding={self.decoding}: the {sampler} sampler has no {' / '.join(missing)} "
                             "decoding yet; use --decoding=exact")
    return {k: v for k, v in fields.items() if k in supported}

  def _transfer_fields(self, sampler: str) -> dict[str, Any]:
    """A sampler whose mode selects its `transfer` rule (block diffusion, LLaDA2.x) decodes with its exact KV
    cache always: exact = its own rule (LLaDA2's: a quota, or every proposal above τ = 0.95), threshold =
    Fast-dLLM's rule at --threshold."""
    if self.window is not None or self.eos_truncation:
      raise CombinationError(f"--decoding={self.decoding}: the {sampler} sampler has no eos_truncation / window "
                             "decoding (Elastic-Cache's: LLaDA, MMaDA and Dream); leave --window and "
                             "--eos_truncation unset")
    if self.cache != "none" or self.rule == "factor":
      raise CombinationError(f"--decoding={self.decoding}: the {sampler} sampler always decodes with its exact "
                             "KV cache and has no factor rule; use --decoding=exact (LLaDA2's rule) or threshold")
    if self.rule == "threshold":
      return {"transfer": "fast_dllm", "threshold": self.threshold}
    return {}

  def check_tokenizer(self, tokenizer) -> None:
    """Refuses (one line) a pc prior file made for another tokenizer than `tokenizer` (a
    `dlm_jax.io.tokenizer.Tokenizer`, or None: nothing to check)."""
    prior = dict(self.knobs).get("prior")
    if self.decoding != "pc" or tokenizer is None or not isinstance(prior, str):
      return
    try:
      corpus_prior.load(prior, vocab=tokenizer.backend.get_vocab(with_added_tokens=True))
    except ValueError as e:
      raise SessionError(f"--decoding=pc: {e}") from None

  def check_guidance(self, cfg_scale: float) -> None:
    """Refuses a KV cache or a compute policy together with classifier-free guidance (the unconditional sequence
    has no cache, and no policy state)."""
    if self.policy != "none" and cfg_scale > 0:
      raise CombinationError(f"--policy={self.policy} does not run with classifier-free guidance (--cfg_scale="
                             f"{cfg_scale:g}); use --cfg_scale=0 or --policy=none")
    if self.cache != "none" and cfg_scale > 0:
      raise CombinationError(f"--decoding={self.decoding} keeps a KV cache, which classifier-free guidance "
                             f"(--cfg_scale={cfg_scale:g}) does not support; use --cfg_scale=0 or a mode without a "
                             "cache")


def _check_threshold(value: float | None) -> None:
  if value is not None and not (isinstance(value, (int, float)) and 0.0 <= value <= 1.0):
    raise SessionError(f"--threshold={value}: expected a confidence in [0, 1]")


def _check_factor(value: float | None) -> None:
  if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
    raise SessionError(f"--factor={value}: expected a finite value > 0")


def from_values(decoding: str, threshold: float = DEFAULT_THRESHOLD, factor: float = DEFAULT_FACTOR,
                dual_cache_forwards: str = DUAL_CACHE_FORWARDS[0],
                knobs: tuple[tuple[str, Any], ...] = (), policy: str = "none", cache: str = "none",
                window: int | None = None, eos_truncation: bool = False) -> DecodingMode:
  """The mode of the flag values: each is checked (a one-line error naming its flag), and the threshold and
  factor are kept only when the mode uses them."""
  _check_threshold(threshold)
  _check_factor(factor)
  if decoding not in ALL_MODES:
    raise SessionError(f"--decoding={decoding}: expected one of {', '.join(ALL_MODES)}")
  rule = ALL_MODES[decoding][0]
  return DecodingMode(decoding, threshold if rule == "threshold" else None, factor if rule == "factor" else None,
                      dual_cache_forwards, knobs if rule in decoding_rules.RULE_NAMES else (), policy, cache, window,
                      eos_truncation)


def from_spec(spec: str) -> DecodingMode:
  """`name` or `name:value` (value = the threshold or factor; default 0.9 / 1.0), or for a decoding rule
  `name:knob=value,knob=value` (e.g. `eb:gamma=0.1`, `pc:prior=prior.json`; `cache=prefix|dual` its KV cache,
  `klass:cache=dual`) -> the mode. A rule's knobs may also be joined by "+" (`eb:gamma=0.1+cache=dual`), for
  lists that commas separate (the benchmarks' --modes); a "+" not followed by `knob=` stays in the value."""
  name, sep, value = spec.partition(":")
  if not sep:
    return from_values(name)
  if name in decoding_rules.RULE_NAMES:
    knobs = dict(_rule_knobs(spec, value))
    cache = str(knobs.pop("cache", "none"))
    return from_values(name, knobs=tuple(sorted(knobs.items())), cache=cache)
  if name not in MODES or MODES[name][0] == "quota":
    raise SessionError(f"decoding mode {spec!r}: only modes with a threshold or factor take ':value'")
  try:
    number = float(value)
  except ValueError:
    raise SessionError(f"decoding mode {spec!r}: expected name:number") from None
  return from_values(name, threshold=number) if MODES[name][0] == "threshold" else from_values(name, factor=number)


def _rule_knobs(spec: str, text: str) -> tuple[tuple[str, Any], ...]:
  """`knob=value,...` (or `knob=value+...`) of a rule spec, numbers parsed (ints stay ints), other values kept as
  strings."""
  knobs = {}
  for item in re.split(r",|\+(?=[A-Za-z_]\w*=)", text):
    key, eq, raw = item.partition("=")
    if not eq or not key:
      raise SessionError(f"decoding mode {spec!r}: expected name:knob=value[,knob=value...]")
    try:
      knobs[key] = int(raw)
    except ValueError:
      try:
        knobs[key] = float(raw)
      except ValueError:
        knobs[key] = raw
  return tuple(sorted(knobs.items()))

