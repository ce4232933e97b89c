"""Thin absl binaries that run the library and write results."""
