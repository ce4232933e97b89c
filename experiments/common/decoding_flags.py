"""--decoding, --threshold, --factor and --dual_cache_forwards (the modes of `experiments.common.decoding_modes`)
as a `DecodingMode`."""

from __future__ import annotations

from absl import flags, logging

from experiments.common import decoding_modes, rule_flags

_DECODING = flags.DEFINE_string("decoding", "exact", "Decoding mode of the diffusion samplers: "
                                + ", ".join(decoding_modes.ALL_MODES) + " (Fast-dLLM's confidence-threshold / factor "
                                "parallel decoding and prefix / dual KV caches, and the decoding rules EB-Sampler, "
                                "KLASS, WINO, PC-Sampler, certainty prior; see experiments.common.decoding_modes).")
_THRESHOLD = flags.DEFINE_float("threshold", decoding_modes.DEFAULT_THRESHOLD, "Confidence threshold in [0, 1] of "
                                "the threshold modes (Fast-dLLM's 0.9).")
_FACTOR = flags.DEFINE_float("factor", decoding_modes.DEFAULT_FACTOR, "f > 0 of --decoding=factor: rank r is "
                             "accepted when its confidence >= 1 - f/(r + 1) (Fast-dLLM's 1.0).")
_DUAL_CACHE_FORWARDS = flags.DEFINE_string(
    "dual_cache_forwards", decoding_modes.DUAL_CACHE_FORWARDS[0], "Model calls a block may take under the dual "
    "cache: until_done (NVlabs' June-2025 code) or steps_per_block (NVlabs' current code: at most --steps / blocks, "
    "leftover masks compete at later refreshes).")


def from_flags() -> decoding_modes.DecodingMode:
  """The decoding flags as a mode (every value checked); warns about --threshold / --factor given for a mode
  that does not use them."""
  mode = decoding_modes.from_values(_DECODING.value, _THRESHOLD.value, _FACTOR.value, _DUAL_CACHE_FORWARDS.value,
                                    rule_flags.knobs(_DECODING.value))
  for name, used in (("threshold", mode.threshold is not None), ("factor", mode.factor is not None)):
    if flags.FLAGS[name].present and not used:
      logging.warning("--%s applies to the modes with a %s rule only; ignored for --decoding=%s", name, name,
                      mode.decoding)
  return mode
