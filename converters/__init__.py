"""Converters from Hugging Face and GGUF checkpoints to dlm_jax directories (see dlm_jax.io.checkpoint)."""

from dlm_jax import extras

extras.report_in_one_line()  # a missing extra while a converter is imported: one line, no traceback
