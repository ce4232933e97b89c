"""JAX's backend probe, quiet where there is nothing to probe.

At start-up JAX tries every backend it knows; one whose plugin library is not installed at all (libtpu.so on
a CPU or GPU machine) is logged at INFO as `Unable to initialize backend 'tpu': ... cannot open shared object
file`, the first line a user sees. `quiet_absent_backends` drops exactly those records. Everything else
stays: a backend that is installed but fails (a TPU in use, a broken CUDA install) is still logged, JAX's
warnings (a GPU without a CUDA jaxlib) are untouched, and a platform the user asked for (JAX_PLATFORMS or
`jax_platforms`) that fails is an exception, never a log record.
"""

from __future__ import annotations

import logging

LOGGER = "jax._src.xla_bridge"
"""The logger of JAX's backend probe."""

_PROBE = "Unable to initialize backend "
_ABSENT = "cannot open shared object file"


class AbsentBackendFilter(logging.Filter):
  """Drops the probe's record for a backend whose library is not installed (module docstring)."""

  def filter(self, record: logging.LogRecord) -> bool:
    message = record.getMessage()
    return not (message.startswith(_PROBE) and _ABSENT in message)


def quiet_absent_backends() -> None:
  """Installs `AbsentBackendFilter` on JAX's probe logger (once)."""
  logger = logging.getLogger(LOGGER)
  if not any(isinstance(f, AbsentBackendFilter) for f in logger.filters):
    logger.addFilter(AbsentBackendFilter())
