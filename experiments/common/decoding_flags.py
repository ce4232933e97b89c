"""The decoding-mode flags: --decoding, --threshold, --factor, --dual_cache_forwards, --cache (a decoding rule's
KV cache), the decoding rules'
knobs (--decoding=eb|klass|wino|pc|certainty_prior; `dlm_jax.sampling.decoding_rules`, defaults those of each
rule's original code) and the compute policy (--policy; `dlm_jax.policy`), as a `dlm_jax.session.DecodingMode`."""

from __future__ import annotations

from typing import Any

from absl import flags, logging

from dlm_jax.policy.registry import policy_names
from dlm_jax.sampling import decoding_rules as dr
from dlm_jax.session import decoding_mode

_DECODING = flags.DEFINE_string("decoding", "exact", "Decoding mode of the diffusion samplers: "
                                + ", ".join(decoding_mode.ALL_MODES) + " (Fast-dLLM's confidence-threshold / factor "
                                "parallel decoding and prefix / dual KV caches, and the decoding rules EB-Sampler, "
                                "KLASS, WINO, PC-Sampler, certainty prior; see dlm_jax.session.decoding_mode).")
_THRESHOLD = flags.DEFINE_float("threshold", decoding_mode.DEFAULT_THRESHOLD, "Confidence threshold in [0, 1] of "
                                "the threshold modes (Fast-dLLM's 0.9).")
_FACTOR = flags.DEFINE_float("factor", decoding_mode.DEFAULT_FACTOR, "f > 0 of --decoding=factor: rank r is "
                             "accepted when its confidence >= 1 - f/(r + 1) (Fast-dLLM's 1.0).")
_DUAL_CACHE_FORWARDS = flags.DEFINE_string(
    "dual_cache_forwards", decoding_mode.DUAL_CACHE_FORWARDS[0], "Model calls a block may take under the dual "
    "cache: until_done (NVlabs' June-2025 code) or steps_per_block (NVlabs' current code: at most --steps / blocks, "
    "leftover masks compete at later refreshes).")
_EB_GAMMA = flags.DEFINE_float("eb_gamma", dr.EBSampler.gamma, "EB-Sampler's entropy budget gamma >= 0 (nats).")
_KLASS_CONF = flags.DEFINE_float("klass_conf_threshold", dr.KLASS.conf_threshold,
                                 "KLASS: confidence a ready token must exceed, in [0, 1].")
_KLASS_KL = flags.DEFINE_float("klass_kl_threshold", dr.KLASS.kl_threshold,
                               "KLASS: every KL of a ready token's history must be below this (> 0).")
_KLASS_HISTORY = flags.DEFINE_integer("klass_kl_history_length", dr.KLASS.kl_history_length,
                                      "KLASS: steps of KL history a ready token needs (>= 1).")
_KLASS_VARIANT = flags.DEFINE_enum("klass_variant", None, list(dr.KLASS_VARIANTS),
                                   "KLASS: llada_klass (KLASS's LLaDA code) or dream_klass (its Dream code: no blocks, "
                                   "one fallback token, confidence >= the bar, no step gate; Dream only). Unset: the "
                                   "model's own (dream_klass on Dream, llada_klass on LLaDA and MMaDA).")
_WINO_IN = flags.DEFINE_float("wino_wide_in", dr.WINO.wide_in, "WINO: draft bar (confidence > it), in [0, 1].")
_WINO_OUT = flags.DEFINE_float("wino_narrow_out", dr.WINO.narrow_out,
                               "WINO: a drafted token is re-masked when its verification probability is below it.")
_PC_PRIOR = flags.DEFINE_string("pc_prior", None, "PC-Sampler: the corpus prior file of the model's tokenizer "
                                "(dlm_jax.sampling.corpus_prior; benchmarks/corpus_prior.py writes one).")
_PC_LAMBDA = flags.DEFINE_float("pc_lambda", dr.PCSampler.lam, "PC-Sampler: position decay lambda >= 0.")
_PC_ALPHA = flags.DEFINE_float("pc_alpha", dr.PCSampler.alpha, "PC-Sampler: clip alpha > 0 of the calibration.")
_PC_VARIANT = flags.DEFINE_enum("pc_variant", "pc_sampler", list(dr.PC_VARIANTS),
                                "PC-Sampler: the original rule, or Research dLLM's debias (no position term).")
_POLICY = flags.DEFINE_string("policy", "none", "Compute policy: NAME or NAME:knob=value,... — "
                              + ", ".join(policy_names()) + " (statistics of one step decide what the next computes; "
                              "docs/guides/compute_policies.md says which decoding modes each runs with).")
_CACHE = flags.DEFINE_enum("cache", "none", list(decoding_mode.RULE_CACHES),
                           "KV cache of --decoding=eb, klass, pc or certainty_prior: none, prefix or dual (Fast-dLLM's "
                           "caches in Research dLLM's order; the other modes name their cache in --decoding).")
_WINDOW = flags.DEFINE_integer("window", None, "Elastic-Cache's decoding: a call's candidates are the first N masks "
                                "of the block (unset: the whole block; Dream: of the generation, no blocks); "
                                "threshold or factor modes without a cache, LLaDA, MMaDA and Dream.")
_EOS_TRUNCATION = flags.DEFINE_bool("eos_truncation", False, "Elastic-Cache's decoding: after the first call that "
                                    "decodes the EOS id the masks after it are never decoded; threshold or factor "
                                    "modes without a cache, LLaDA, MMaDA and Dream (no blocks).")
_CERTAINTY_SIGMA = flags.DEFINE_float("certainty_sigma", dr.CertaintyPrior.sigma,
                                      "Certainty prior: the Gaussian's sigma in positions (> 0).")


def rule_knobs(decoding: str) -> tuple[tuple[str, Any], ...]:
  """The knobs of rule `decoding` from the flags ((name, value) pairs; () for a mode that is not a rule)."""
  flat = {"eb_gamma": _EB_GAMMA, "klass_conf_threshold": _KLASS_CONF, "klass_kl_threshold": _KLASS_KL,
          "klass_kl_history_length": _KLASS_HISTORY, "klass_variant": _KLASS_VARIANT, "wino_wide_in": _WINO_IN,
          "wino_narrow_out": _WINO_OUT, "pc_prior": _PC_PRIOR, "pc_lambda": _PC_LAMBDA, "pc_alpha": _PC_ALPHA,
          "pc_variant": _PC_VARIANT, "certainty_sigma": _CERTAINTY_SIGMA}
  return decoding_mode.rule_knobs(decoding, {name: flag.value for name, flag in flat.items()})


def from_flags() -> decoding_mode.DecodingMode:
  """The decoding flags as a mode (every value checked); warns about --threshold / --factor given for a mode
  that does not use them."""
  mode = decoding_mode.from_values(_DECODING.value, _THRESHOLD.value, _FACTOR.value, _DUAL_CACHE_FORWARDS.value,
                                   rule_knobs(_DECODING.value), _POLICY.value, _CACHE.value, _WINDOW.value,
                                   _EOS_TRUNCATION.value)
  for name, used in (("threshold", mode.threshold is not None), ("factor", mode.factor is not None)):
    if flags.FLAGS[name].present and not used:
      logging.warning("--%s applies to the modes with a %s rule only; ignored for --decoding=%s", name, name,
                      mode.decoding)
  return mode
