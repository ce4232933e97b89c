r"""A full-size converted checkpoint of a preset with random weights and a stand-in tokenizer, for measuring
what a machine can run before downloading real weights.

  python -m benchmarks.random_checkpoint --preset=qwen3-0.6b-a2d-mdlm --out_dir=/tmp/qwen3-a2d-mdlm-random \
      [--dtype=bfloat16] [--seed=0]

Weights: `dlm_jax.model.init_params` of the preset, cast to --dtype and written with
`dlm_jax.io.checkpoint.save` (atomically; an existing --out_dir is refused). Tokenizer: a word-level stand-in with
one entry per embedding row — the words of experiments/data/simple_qa.jsonl first, then "<w{id}>" — and the
preset's special ids (Qwen3 presets: <|endoftext|>, <|im_start|>, <|im_end|>, <think>, </think>, <|mask|> at
their Qwen3 ids) as special tokens, so prompts encode to real ids and every generated id decodes. The text
is meaningless (random weights); costs are those of the real model. Exit 1 with a one-line error on bad input.
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
from absl import app, flags

from dlm_jax import model
from dlm_jax.io import checkpoint
from benchmarks.stand_in_tokenizer import stand_in_tokenizer
from dlm_jax.config import ConfigError, preset

_PRESET = flags.DEFINE_string("preset", "qwen3-0.6b-a2d-mdlm", "A dlm_jax.config preset name.")
_OUT_DIR = flags.DEFINE_string("out_dir", None, "Output directory (must not exist or be empty).")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ("bfloat16", "float32"), "Stored dtype.")
_SEED = flags.DEFINE_integer("seed", 0, "PRNG seed of the weights.")

def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  if not _OUT_DIR.value:
    raise app.UsageError("--out_dir is required.")
  try:
    config = preset(_PRESET.value)
    checkpoint.check_output_dir(_OUT_DIR.value)
  except (ConfigError, checkpoint.CheckpointError) as e:
    print(f"benchmarks.random_checkpoint: error: {e}", file=sys.stderr)
    sys.exit(1)
  dtype = jnp.bfloat16 if _DTYPE.value == "bfloat16" else jnp.float32
  params = jax.jit(lambda key: jax.tree.map(lambda x: x.astype(dtype), model.init_params(config, key)))(
      jax.random.key(_SEED.value))
  with checkpoint.atomic_output_dir(_OUT_DIR.value) as tmp:
    checkpoint.save(tmp, config, jax.device_get(params))
    stand_in_tokenizer(config).save(os.path.join(tmp, "tokenizer.json"))
  print(f"Wrote {_OUT_DIR.value}: {config.name}, {model.param_count(config):,} parameters, {_DTYPE.value}.")


if __name__ == "__main__":
  app.run(main)
