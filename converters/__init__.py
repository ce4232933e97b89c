"""Converters from Hugging Face and GGUF checkpoints to dlm_jax directories (see dlm_jax.io.checkpoint)."""
