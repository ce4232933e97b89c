"""Model configuration: `ModelConfig` (model_config.py: one frozen, hashable, validated dataclass for every
supported model), the presets of every supported checkpoint (presets.py) and the size ceilings a config must
stay under before anything is allocated (limits.py)."""

from dlm_jax.config.model_config import ConfigError, ModelConfig
from dlm_jax.config.presets import PRESETS, preset

__all__ = ["PRESETS", "ConfigError", "ModelConfig", "preset"]
