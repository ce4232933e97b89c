r"""Converts a Llama-architecture GGUF file (e.g. SmolLM2) into a dlm_jax directory.

  python -m converters.gguf --gguf=FILE.gguf --out_dir=DIR [--dtype=float32|bfloat16] [--overwrite]

Weights are dequantized with the `gguf` package and llama.cpp's q/k row permutation is undone; the
tokenizer.json and tokenizer_config.json (with the chat template) are built from the GGUF metadata.
The work is done by `converters.gguf_import.convert_gguf`.
"""

from __future__ import annotations

import os
import sys
import time

from absl import app, flags, logging

from converters.gguf_import import OUTPUT_DTYPES, convert_gguf
from dlm_jax.io.checkpoint import CheckpointError
from dlm_jax.config import ConfigError
from experiments.common import cli

_GGUF = flags.DEFINE_string("gguf", None, "GGUF file (llama architecture).")
_OUT_DIR = flags.DEFINE_string("out_dir", None, "Output directory (absent or empty unless --overwrite).")
_DTYPE = flags.DEFINE_enum("dtype", "float32", tuple(OUTPUT_DTYPES), "Stored dtype of the dequantized weights.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace a non-empty --out_dir.")


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  if not _GGUF.value or not _OUT_DIR.value:
    raise app.UsageError("--gguf and --out_dir are required.")
  if os.path.isdir(_GGUF.value):
    gguf_files = sorted(f for f in os.listdir(_GGUF.value) if f.endswith(".gguf"))
    hint = f" (it holds {', '.join(gguf_files)})" if gguf_files else ""
    print(f"converters.gguf: error: --gguf={_GGUF.value} is a directory{hint}; expected a .gguf file",
          file=sys.stderr)
    sys.exit(1)
  if not os.path.isfile(_GGUF.value):
    print(f"converters.gguf: error: --gguf={_GGUF.value}: no such file", file=sys.stderr)
    sys.exit(1)
  start = time.perf_counter()
  try:
    config = convert_gguf(_GGUF.value, _OUT_DIR.value, dtype=_DTYPE.value, overwrite=_OVERWRITE.value,
                          progress=logging.info)
  except (CheckpointError, ConfigError) as e:
    print(f"converters.gguf: error: {e}", file=sys.stderr)
    sys.exit(1)
  logging.info("Converted %s (%d layers, d_model %d) to %s in %.1fs.", config.name, config.n_layers,
               config.d_model, _OUT_DIR.value, time.perf_counter() - start)


if __name__ == "__main__":
  cli.run(main)
