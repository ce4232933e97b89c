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

import json
import os
import re
import sys

import jax
import jax.numpy as jnp
from absl import app, flags
from tokenizers import Tokenizer, models, pre_tokenizers

from dlm_jax import model
from dlm_jax.io import checkpoint
from dlm_jax.config import ConfigError, ModelConfig, preset

_PRESET = flags.DEFINE_string("preset", "qwen3-0.6b-a2d-mdlm", "A dlm_jax.config preset name.")
_OUT_DIR = flags.DEFINE_string("out_dir", None, "Output directory (must not exist or be empty).")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ("bfloat16", "float32"), "Stored dtype.")
_SEED = flags.DEFINE_integer("seed", 0, "PRNG seed of the weights.")

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN3_SPECIALS = {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>", 151667: "<think>",
                  151668: "</think>", 151669: "<|mask|>"}
"""small_dlms.md §2.4."""


def stand_in_tokenizer(config: ModelConfig) -> Tokenizer:
  """A word-level tokenizer over config.vocab_size ids (module docstring)."""
  specials = dict(QWEN3_SPECIALS) if config.vocab_size == 151936 else {}
  for field in ("mask_token_id", "eos_token_id", "eot_token_id", "bos_token_id", "pad_token_id"):
    value = getattr(config, field)
    if value is not None and value not in specials:
      specials[value] = f"<|{field.removesuffix('_token_id')}|>"
  with open(os.path.join(_REPO, "experiments", "data", "simple_qa.jsonl"), encoding="utf-8") as f:
    text = " ".join(json.loads(line)["question"] for line in f if line.strip())
  words = list(dict.fromkeys(["<unk>"] + re.findall(r"\w+|[^\w\s]", text)))
  vocab, free = {}, iter(i for i in range(config.vocab_size) if i not in specials)
  for word in words:
    vocab[word] = next(free)
  for index in free:
    vocab[f"<w{index}>"] = index
  vocab.update({token: index for index, token in specials.items()})
  tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
  tokenizer.add_special_tokens(list(specials.values()))
  return tokenizer


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
