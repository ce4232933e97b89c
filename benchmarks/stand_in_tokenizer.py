"""The stand-in tokenizer of `benchmarks.random_checkpoint`: a word-level tokenizer with one entry per embedding
row and the preset's special ids (that module's docstring). A module of its own so that it is importable
without the binary's flags."""

from __future__ import annotations

import json
import os
import re

from tokenizers import Tokenizer, models, pre_tokenizers

from dlm_jax.config import ModelConfig

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
