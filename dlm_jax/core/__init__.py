"""Types shared below `dlm_jax.model` and `dlm_jax.instrument` (the attention bias)."""
