"""Thin absl binaries that run the library and write results."""

from dlm_jax import extras

extras.report_in_one_line()  # a missing extra while a binary is imported: one line, no traceback
