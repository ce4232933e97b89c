r"""One forward pass of a converted checkpoint on one unpadded sequence; writes logits and attention sums.

  python -m experiments.forward --checkpoint=DIR|tiny-dlm|tiny-arm|smollm2 --token_ids=1,2,3 --out=FILE.npz

FILE.npz holds
  logits              float32 [S, V]  raw logits, no shift (Dream and the ARMs predict token i+1 at i)
  incoming_attention  float32 [L, N, S]  per layer and query head, the attention each key receives,
                      summed over all S queries
  token_ids           int32 [S]
The attention follows the config (bidirectional for the DLMs, causal for the ARMs), positions 0..S-1.

Weights holding NaN or inf are refused at load (naming the tensor and layer), and logits that are not
finite are refused naming the first layer whose attention is already not finite (the first layer that
received a non-finite input), or the final norm / LM head when every layer's attention is finite; nothing
is written. --allow_nonfinite loads such weights and writes such outputs anyway, with a warning.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags, logging

from dlm_jax.io import checkpoint
from dlm_jax.config import ModelConfig
from dlm_jax.model import CallInstruments, Compute, Params, forward
from dlm_jax.instrument.stats import StatsSpec
from experiments.common import atomic_files, checkpoints, cli, run_dir

_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "Converted checkpoint directory, or "
                                  f"{', '.join(checkpoints.NAMES)}.")
_TOKEN_IDS = flags.DEFINE_list("token_ids", None, "Comma-separated token ids of one sequence.")
_OUT = flags.DEFINE_string("out", None, "Output .npz file.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ("float32", "bfloat16"), "Parameter and activation dtype.")
_MATMUL_PRECISION = flags.DEFINE_enum("matmul_precision", "highest", ("default", "high", "highest"),
                                      "jax_default_matmul_precision.")
_ATTENTION_IMPL = flags.DEFINE_enum("attention_impl", "chunked", ("chunked", "dense"), "Attention path.")
_ALLOW_NONFINITE = flags.DEFINE_bool("allow_nonfinite", False, "Load non-finite weights and write non-finite "
                                     "outputs (with a warning) instead of refusing them.")


def forward_with_attention(config: ModelConfig, params: Params, token_ids: Sequence[int], *,
                           attention_impl: str = "chunked") -> tuple[np.ndarray, np.ndarray]:
  """Runs one sequence; returns float32 logits [S, V] and incoming attention [L, N, S]."""
  ids = np.asarray(token_ids, dtype=np.int64)
  if ids.ndim != 1 or not len(ids):
    raise ValueError("token_ids must be a non-empty list of ids.")
  bad = ids[(ids < 0) | (ids >= config.vocab_size)]
  if bad.size:
    raise ValueError(f"token id {int(bad[0])} is outside the vocabulary [0, {config.vocab_size}).")
  run = jax.jit(forward, static_argnames=("config",))
  out = run(params, jnp.asarray(ids[None], jnp.int32), config=config,
            instruments=CallInstruments(stats_spec=StatsSpec(incoming_attention=True, per_head=True)),
            compute=Compute(attention_impl=attention_impl))
  logits = np.asarray(out.logits[0], np.float32)
  incoming = np.asarray(out.incoming_attention[:, 0, 0], np.float32)  # [L, B, Q=1, N, S] -> [L, N, S]
  return logits, incoming


def nonfinite_message(logits: np.ndarray, incoming: np.ndarray) -> str | None:
  """Why the outputs are not finite — how many logits, and where it starts (module docstring) — or None."""
  bad = int(np.size(logits) - np.count_nonzero(np.isfinite(logits)))
  if not bad:
    return None
  layers = [l for l in range(incoming.shape[0]) if not np.isfinite(incoming[l]).all()]
  where = (f"layer {layers[0]}'s attention is the first that is not finite (its input is not)" if layers
           else "every layer's attention is finite, so it starts at the last layer's feed-forward, the final norm "
           "or the LM head")
  return f"{bad} of {np.size(logits)} logits are NaN or inf; {where}"


@dataclasses.dataclass(frozen=True)
class Settings:
  """One forward pass: the checkpoint directory, the token ids and the numerics."""

  checkpoint: str
  token_ids: tuple[int, ...]
  dtype: str
  matmul_precision: str
  attention_impl: str


def main(argv: list[str]) -> None:
  del argv
  if not _CHECKPOINT.value or not _TOKEN_IDS.value or not _OUT.value:
    raise cli.UsageError("--checkpoint, --token_ids and --out are required")
  try:
    ids = tuple(int(t) for t in _TOKEN_IDS.value)
  except ValueError:
    raise cli.UsageError(f"--token_ids must be comma-separated integers, got {','.join(_TOKEN_IDS.value)}") from None
  run_dir.check_output_file(_OUT.value, "out")
  _, directory = checkpoints.resolve(_CHECKPOINT.value)
  settings = Settings(directory, ids, _DTYPE.value, _MATMUL_PRECISION.value, _ATTENTION_IMPL.value)
  jax.config.update("jax_default_matmul_precision", settings.matmul_precision)
  config, params = checkpoint.load(settings.checkpoint, dtype=jnp.dtype(settings.dtype),
                                   check_finite=not _ALLOW_NONFINITE.value)
  bad = [i for i in settings.token_ids if not 0 <= i < config.vocab_size]
  if bad:
    raise cli.UserError(f"--token_ids: token id {bad[0]} is outside the vocabulary [0, {config.vocab_size})")
  logits, incoming = forward_with_attention(config, params, settings.token_ids, attention_impl=settings.attention_impl)
  problem = nonfinite_message(logits, incoming)
  if problem and not _ALLOW_NONFINITE.value:
    raise cli.UserError(f"{settings.checkpoint}: {problem}; nothing was written (--allow_nonfinite writes it anyway)")
  if problem:
    logging.warning("%s", problem)
  atomic_files.write_npz(_OUT.value, logits=logits, incoming_attention=incoming,
                         token_ids=np.asarray(settings.token_ids, np.int32))


if __name__ == "__main__":
  cli.run(main)
