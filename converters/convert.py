r"""Converts a Hugging Face LLaDA / MMaDA / Dream / Llama / Qwen2 / LLaDA-MoE / LLaDA2.x / DiffusionGemma (text
only) / Qwen3 / dllm A2D (Tiny-A2D, TIDE) / SDAR checkpoint into a dlm_jax directory.

  python -m converters.convert --arch=auto --hf_dir=/ckpt/LLaDA-8B-Instruct --out_dir=/ckpt/llada-8b \
      [--dtype=auto|bfloat16|float32|float16] [--overwrite]

--arch=auto reads model_type / architectures from config.json (a "llada" config with expert fields is
LLaDA-MoE). --block_size and --mask_token_id set what the Qwen3-layout diffusion checkpoints may not say
(converters.hf_qwen3). --dtype=auto keeps the dtype of the
source embedding. The work is done by `converters.hf_convert.convert`; errors (missing, unexpected,
misshapen or non-float tensors, unreadable files, missing or unsupported config fields, a non-empty
--out_dir without --overwrite) are printed with the tensor or field named, exit status 1, and
--out_dir is left untouched. --out_dir may not be --hf_dir, a parent of it or inside it (links resolved);
a symlinked --out_dir is written through (the link's target is replaced atomically, the link stays).
A killed conversion's hidden temporary directory is removed by the next conversion to the same --out_dir.
"""

from __future__ import annotations

import sys
import time

from absl import app, flags, logging

from converters.hf_config import ARCHS
from converters.hf_convert import OUTPUT_DTYPES, convert
from converters.plan import DEFAULT_CHUNK_BYTES
from dlm_jax.io.checkpoint import DEFAULT_MAX_SHARD_BYTES, CheckpointError
from dlm_jax.config import ConfigError
from experiments.common import cli

_ARCH = flags.DEFINE_enum("arch", "auto", ("auto",) + ARCHS, "Source family; auto reads config.json.")
_HF_DIR = flags.DEFINE_string("hf_dir", None, "Hugging Face checkpoint directory.")
_OUT_DIR = flags.DEFINE_string("out_dir", None, "Output directory (absent or empty unless --overwrite).")
_DTYPE = flags.DEFINE_enum("dtype", "auto", ("auto",) + tuple(OUTPUT_DTYPES),
                           "Stored dtype; auto keeps the dtype of the source embedding.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace a non-empty --out_dir.")
_CHUNK_MB = flags.DEFINE_integer("chunk_mb", DEFAULT_CHUNK_BYTES // 2**20,
                                 "Source rows are read in blocks of about this many MiB.")
_BLOCK_SIZE = flags.DEFINE_integer(
    "block_size", None, "Qwen3-layout diffusion variants (a2d-qwen3, a2d-qwen2, sdar): block-causal attention with "
    "blocks of this length, 0 = bidirectional; unset: SDAR's config.json, else 32 when the checkpoint's name says "
    "bd3lm or tide, else bidirectional (MDLM).")
_MASK_TOKEN_ID = flags.DEFINE_integer(
    "mask_token_id", None, "Qwen3-layout diffusion variants: the mask id; unset: config.json, else the tokenizer "
    "files' mask token, else 151669.")
_MAX_SHARD_GB = flags.DEFINE_float("max_shard_gb", DEFAULT_MAX_SHARD_BYTES / 2**30, "Output shard size limit, GiB.")


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  if not _HF_DIR.value or not _OUT_DIR.value:
    raise app.UsageError("--hf_dir and --out_dir are required.")
  if _CHUNK_MB.value < 1:
    raise app.UsageError(f"--chunk_mb={_CHUNK_MB.value}: expected a positive number of MiB")
  if not _MAX_SHARD_GB.value > 0:
    raise app.UsageError(f"--max_shard_gb={_MAX_SHARD_GB.value}: expected a size > 0 (GiB)")
  start = time.perf_counter()
  try:
    config = convert(_HF_DIR.value, _OUT_DIR.value, arch=_ARCH.value, dtype=_DTYPE.value,
                     overwrite=_OVERWRITE.value, chunk_bytes=_CHUNK_MB.value * 2**20,
                     max_shard_bytes=int(_MAX_SHARD_GB.value * 2**30), progress=logging.info,
                     block_size=_BLOCK_SIZE.value, mask_token_id=_MASK_TOKEN_ID.value)
  except (CheckpointError, ConfigError) as e:
    print(f"converters.convert: error: {e}", file=sys.stderr)
    sys.exit(1)
  logging.info("Converted %s (%d layers, d_model %d) to %s in %.1fs.", config.name, config.n_layers,
               config.d_model, _OUT_DIR.value, time.perf_counter() - start)


if __name__ == "__main__":
  cli.run(main)
