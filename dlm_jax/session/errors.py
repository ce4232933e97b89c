"""The decoding session's one error type: a setting that is wrong or does not fit the model.

`SessionError` is a `ValueError` whose message is one line naming the setting and what was expected. The
session's settings are the binaries' flags and lm-eval's model_args under the same names, so a message names
a setting as its flag (`--decoding=fast: expected one of ...`); the binaries report it as their one-line
error unchanged (`experiments.common.cli`), the lm-eval model prefixes its model_args name.
`CombinationError` marks settings that do not go together (a KV cache with guidance, a mode the sampler
lacks): the binaries add their pointer to --helpfull, as for a usage error.
"""

from __future__ import annotations


class SessionError(ValueError):
  """A setting of a decoding session that is wrong or does not fit the model (one line)."""


class CombinationError(SessionError):
  """Settings that do not go together (one line)."""
