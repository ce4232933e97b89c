"""The library's error for checkpoints and their files (re-exported by `dlm_jax.io.checkpoint`)."""


class CheckpointError(ValueError):
  """A checkpoint is missing, malformed or does not match its config; the message names the tensor/file."""
