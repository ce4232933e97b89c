"""Test-wide JAX settings: CPU, float32, highest matmul precision (parity needs exact f32 matmuls)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (the environment must be set before JAX initialises)

jax.config.update("jax_default_matmul_precision", "highest")
