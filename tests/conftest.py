"""Test-wide JAX settings: CPU with 8 virtual devices (sharding tests), float32, highest matmul precision."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (the environment must be set before JAX initialises)

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_default_matmul_precision", "highest")
