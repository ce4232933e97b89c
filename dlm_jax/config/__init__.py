"""Model configuration: `ModelConfig` (model_config.py: one frozen, hashable, validated dataclass for every
supported model) and the presets of every supported checkpoint (presets.py)."""

from dlm_jax.config.model_config import ConfigError, ModelConfig
from dlm_jax.config.presets import PRESETS, preset

__all__ = ["PRESETS", "ConfigError", "ModelConfig", "preset"]
