"""dlm_jax: run and dissect diffusion language models in JAX.

The public API, by name (resolved on first use, so `import dlm_jax` stays light):

  configuration   ModelConfig, ConfigError, preset
  model           forward, init_params, KVCache              (dlm_jax.model)
  checkpoints     load_checkpoint, save_checkpoint           (dlm_jax.io.checkpoint.load / save)
  tokenizers      Tokenizer                                  (dlm_jax.io.tokenizer)
  statistics      StatsSpec                                  (dlm_jax.instrument.stats)
  interventions   MaskKeys, MaskPreviousSinks, SinkToken, Compose, NO_INTERVENTION
                                                             (dlm_jax.instrument.interventions)
  activations     Hooks, Capture, Edit, Steps, CaptureValues, hook_values: capture and edit named sites
                  at any step of any sampler (dlm_jax.instrument.hook_spec, hook_call, sites)
  samplers        LLaDAOptions, DreamOptions, AROptions, BlockDiffusionOptions, DiffusionGemmaOptions,
                  Trace, and the modules llada, dream, autoregressive, block_diffusion, diffusion_gemma
                  whose `generate` (Dream: `diffusion_generate`) runs one compiled decoding  (dlm_jax.sampling)
  scaling out     make_mesh, parse_mesh                      (dlm_jax.runtime.sharding)

Everything else is reached through its package: config, model, instrument, sampling, analysis, training, io,
runtime, tasks, session (the decoding session the binaries share; BUILD.md, "Layout"). The modules' paths before
that layout (dlm_jax.checkpoint, dlm_jax.stats, ...) still import, with a DeprecationWarning naming the new path (`dlm_jax._moved_modules`, CHANGELOG.md).
"""

import importlib

from dlm_jax import _moved_modules

_moved_modules.install()

_EXPORTS = {
    "ModelConfig": ("dlm_jax.config", "ModelConfig"),
    "ConfigError": ("dlm_jax.config", "ConfigError"),
    "preset": ("dlm_jax.config", "preset"),
    "forward": ("dlm_jax.model", "forward"),
    "init_params": ("dlm_jax.model", "init_params"),
    "KVCache": ("dlm_jax.model", "KVCache"),
    "load_checkpoint": ("dlm_jax.io.checkpoint", "load"),
    "save_checkpoint": ("dlm_jax.io.checkpoint", "save"),
    "Tokenizer": ("dlm_jax.io.tokenizer", "Tokenizer"),
    "StatsSpec": ("dlm_jax.instrument.stats", "StatsSpec"),
    "MaskKeys": ("dlm_jax.instrument.interventions", "MaskKeys"),
    "MaskPreviousSinks": ("dlm_jax.instrument.interventions", "MaskPreviousSinks"),
    "SinkToken": ("dlm_jax.instrument.interventions", "SinkToken"),
    "Compose": ("dlm_jax.instrument.interventions", "Compose"),
    "NO_INTERVENTION": ("dlm_jax.instrument.interventions", "NO_INTERVENTION"),
    "Hooks": ("dlm_jax.instrument.hook_spec", "Hooks"),
    "Capture": ("dlm_jax.instrument.hook_spec", "Capture"),
    "Edit": ("dlm_jax.instrument.hook_spec", "Edit"),
    "Steps": ("dlm_jax.instrument.hook_spec", "Steps"),
    "CaptureValues": ("dlm_jax.instrument.hook_call", "CaptureValues"),
    "hook_values": ("dlm_jax.instrument.hook_call", "hook_values"),
    "StepSchedule": ("dlm_jax.instrument.step_schedule", "StepSchedule"),
    "Gate": ("dlm_jax.instrument.step_schedule", "Gate"),
    "CoefficientSchedule": ("dlm_jax.instrument.step_schedule", "CoefficientSchedule"),
    "LLaDAOptions": ("dlm_jax.sampling", "LLaDAOptions"),
    "DreamOptions": ("dlm_jax.sampling", "DreamOptions"),
    "AROptions": ("dlm_jax.sampling", "AROptions"),
    "BlockDiffusionOptions": ("dlm_jax.sampling", "BlockDiffusionOptions"),
    "DiffusionGemmaOptions": ("dlm_jax.sampling", "DiffusionGemmaOptions"),
    "Trace": ("dlm_jax.sampling", "Trace"),
    "llada": ("dlm_jax.sampling.llada", None),
    "dream": ("dlm_jax.sampling.dream", None),
    "autoregressive": ("dlm_jax.sampling.autoregressive", None),
    "block_diffusion": ("dlm_jax.sampling.block_diffusion", None),
    "diffusion_gemma": ("dlm_jax.sampling.diffusion_gemma", None),
    "make_mesh": ("dlm_jax.runtime.sharding", "make_mesh"),
    "parse_mesh": ("dlm_jax.runtime.sharding", "parse_mesh"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
  if name not in _EXPORTS:
    raise AttributeError(f"module 'dlm_jax' has no attribute {name!r}")
  module_name, attribute = _EXPORTS[name]
  module = importlib.import_module(module_name)
  value = module if attribute is None else getattr(module, attribute)
  globals()[name] = value
  return value


def __dir__():
  return sorted(set(globals()) | set(_EXPORTS))
