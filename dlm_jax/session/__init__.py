"""The decoding session: a checkpoint and the settings it is decoded with, resolved once for every entry point.

`experiments.generate`, the analysis binaries, the lm-eval model (`experiments.lm_eval`) and the benchmarks
share this one path from settings to a sampler call:

  checkpoint_bundle  `Model` (config, weights, tokenizer, training record, sampler, prompt layout): `describe`
                     a converted directory without its weights, then `load_weights`; the sampler check
  training_record    the training.json a checkpoint trained here carries (prompt width, answer width, sink)
  decoding_mode      `DecodingMode`: exact, Fast-dLLM's threshold / factor / caches, the decoding rules
                     (`from_values`, `from_spec`, `from_record`) and the option fields a mode sets
  decode_settings    `DecodeSettings` and `model_settings`: the per-model decoding values (defaults resolved,
                     recorded with the results)
  sampler_options    the one resolver from common settings + decoding mode + block rule to a sampler's options,
                     with the fit checks (`check_fit`) written once
  steering_file      steering files (activation additions at named sites) read and turned into hooks
  size_limits        ceilings on the sizes taken from settings, checked before anything is allocated
  errors             `SessionError` (a `ValueError`, one line), `CombinationError`

Which checkpoint names exist (`tiny-dlm`, `smollm2`), flags, devices, prompts and results files are the
binaries' (`experiments.common`). This package never imports `experiments/`.
"""

from __future__ import annotations

import importlib

from dlm_jax.session.errors import CombinationError, SessionError

_LAZY = {"Model": "checkpoint_bundle", "DecodeSettings": "decode_settings", "model_settings": "decode_settings",
         "DecodingMode": "decoding_mode"}
"""Names re-exported from the modules that import the samplers, loaded on first use so that the light modules
(`errors`, `size_limits`, `training_record`) import without JAX."""

__all__ = ["CombinationError", "DecodeSettings", "DecodingMode", "Model", "SessionError", "model_settings"]


def __getattr__(name: str):
  if name in _LAZY:
    return getattr(importlib.import_module(f"dlm_jax.session.{_LAZY[name]}"), name)
  raise AttributeError(f"module 'dlm_jax.session' has no attribute {name!r}")
