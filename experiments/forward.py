r"""One forward pass of a converted checkpoint on one unpadded sequence; writes logits and attention sums.

  python -m experiments.forward --checkpoint=DIR --token_ids=1,2,3 --out=FILE.npz

FILE.npz holds
  logits              float32 [S, V]  raw logits, no shift (Dream and the ARMs predict token i+1 at i)
  incoming_attention  float32 [L, N, S]  per layer and query head, the attention each key receives,
                      summed over all S queries
  token_ids           int32 [S]
The attention follows the config (bidirectional for the DLMs, causal for the ARMs), positions 0..S-1.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from dlm_jax import checkpoint
from dlm_jax.config import ConfigError, ModelConfig
from dlm_jax.model import Params, forward
from dlm_jax.stats import StatsSpec

_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "Converted checkpoint directory.")
_TOKEN_IDS = flags.DEFINE_list("token_ids", None, "Comma-separated token ids of one sequence.")
_OUT = flags.DEFINE_string("out", None, "Output .npz file.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ("float32", "bfloat16"), "Parameter and activation dtype.")
_MATMUL_PRECISION = flags.DEFINE_enum("matmul_precision", "highest", ("default", "high", "highest"),
                                      "jax_default_matmul_precision.")
_ATTENTION_IMPL = flags.DEFINE_enum("attention_impl", "chunked", ("chunked", "dense"), "Attention path.")


def forward_with_attention(config: ModelConfig, params: Params, token_ids: Sequence[int], *,
                           attention_impl: str = "chunked") -> tuple[np.ndarray, np.ndarray]:
  """Runs one sequence; returns float32 logits [S, V] and incoming attention [L, N, S]."""
  ids = np.asarray(token_ids, dtype=np.int64)
  if ids.ndim != 1 or not len(ids):
    raise ValueError("token_ids must be a non-empty list of ids.")
  bad = ids[(ids < 0) | (ids >= config.vocab_size)]
  if bad.size:
    raise ValueError(f"token id {int(bad[0])} is outside the vocabulary [0, {config.vocab_size}).")
  run = jax.jit(forward, static_argnames=("config", "stats_spec", "attention_impl"))
  out = run(params, jnp.asarray(ids[None], jnp.int32), config=config,
            stats_spec=StatsSpec(incoming_attention=True, per_head=True), attention_impl=attention_impl)
  logits = np.asarray(out.logits[0], np.float32)
  incoming = np.asarray(out.incoming_attention[:, 0, 0], np.float32)  # [L, B, Q=1, N, S] -> [L, N, S]
  return logits, incoming


def write_npz(path: str, **arrays: np.ndarray) -> None:
  """Writes `arrays` to `path` through a temporary file and a rename."""
  tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
  try:
    with open(tmp, "wb") as f:
      np.savez(f, **arrays)
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  if not _CHECKPOINT.value or not _TOKEN_IDS.value or not _OUT.value:
    raise app.UsageError("--checkpoint, --token_ids and --out are required.")
  jax.config.update("jax_default_matmul_precision", _MATMUL_PRECISION.value)
  try:
    ids = [int(t) for t in _TOKEN_IDS.value]
  except ValueError:
    raise app.UsageError(f"--token_ids must be comma-separated integers, got {_TOKEN_IDS.value}.") from None
  try:
    config, params = checkpoint.load(_CHECKPOINT.value, dtype=jnp.dtype(_DTYPE.value))
    logits, incoming = forward_with_attention(config, params, ids, attention_impl=_ATTENTION_IMPL.value)
  except (checkpoint.CheckpointError, ConfigError, ValueError) as e:
    print(f"experiments.forward: error: {e}", file=sys.stderr)
    sys.exit(1)
  write_npz(_OUT.value, logits=logits, incoming_attention=incoming, token_ids=np.asarray(ids, np.int32))


if __name__ == "__main__":
  app.run(main)
