"""The knobs of the decoding rules (--decoding=eb|klass|wino|pc|certainty_prior;
`dlm_jax.sampling.decoding_rules`) as flags, defaults those of each rule's original code."""

from __future__ import annotations

from typing import Any

from absl import flags

from dlm_jax.sampling import decoding_rules as dr
from experiments.common import decoding_modes

_EB_GAMMA = flags.DEFINE_float("eb_gamma", dr.EBSampler.gamma, "EB-Sampler's entropy budget gamma >= 0 (nats).")
_KLASS_CONF = flags.DEFINE_float("klass_conf_threshold", dr.KLASS.conf_threshold,
                                 "KLASS: confidence a ready token must exceed, in [0, 1].")
_KLASS_KL = flags.DEFINE_float("klass_kl_threshold", dr.KLASS.kl_threshold,
                               "KLASS: every KL of a ready token's history must be below this (> 0).")
_KLASS_HISTORY = flags.DEFINE_integer("klass_kl_history_length", dr.KLASS.kl_history_length,
                                      "KLASS: steps of KL history a ready token needs (>= 1).")
_WINO_IN = flags.DEFINE_float("wino_wide_in", dr.WINO.wide_in, "WINO: draft bar (confidence > it), in [0, 1].")
_WINO_OUT = flags.DEFINE_float("wino_narrow_out", dr.WINO.narrow_out,
                               "WINO: a drafted token is re-masked when its verification probability is below it.")
_PC_PRIOR = flags.DEFINE_string("pc_prior", None, "PC-Sampler: the corpus prior file of the model's tokenizer "
                                "(dlm_jax.sampling.corpus_prior; benchmarks/corpus_prior.py writes one).")
_PC_LAMBDA = flags.DEFINE_float("pc_lambda", dr.PCSampler.lam, "PC-Sampler: position decay lambda >= 0.")
_PC_ALPHA = flags.DEFINE_float("pc_alpha", dr.PCSampler.alpha, "PC-Sampler: clip alpha > 0 of the calibration.")
_PC_VARIANT = flags.DEFINE_enum("pc_variant", "pc_sampler", list(dr.PC_VARIANTS),
                                "PC-Sampler: the original rule, or Research dLLM's debias (no position term).")
_CERTAINTY_SIGMA = flags.DEFINE_float("certainty_sigma", dr.CertaintyPrior.sigma,
                                      "Certainty prior: the Gaussian's sigma in positions (> 0).")


def knobs(decoding: str) -> tuple[tuple[str, Any], ...]:
  """The knobs of rule `decoding` from the flags ((name, value) pairs; () for a mode that is not a rule)."""
  flat = {"eb_gamma": _EB_GAMMA, "klass_conf_threshold": _KLASS_CONF, "klass_kl_threshold": _KLASS_KL,
          "klass_kl_history_length": _KLASS_HISTORY, "wino_wide_in": _WINO_IN, "wino_narrow_out": _WINO_OUT,
          "pc_prior": _PC_PRIOR, "pc_lambda": _PC_LAMBDA, "pc_alpha": _PC_ALPHA, "pc_variant": _PC_VARIANT,
          "certainty_sigma": _CERTAINTY_SIGMA}
  return decoding_modes.rule_knobs(decoding, {name: flag.value for name, flag in flat.items()})
