"""A Hugging Face `tokenizers` tokenizer.json (and tokenizer_config.json) from GGUF tokenizer metadata.

Supports GGUF's "gpt2" tokenizer model: byte-level BPE with `tokenizer.ggml.tokens` (id order),
`tokenizer.ggml.merges` ("a b" strings, in priority order) and `tokenizer.ggml.token_type`
(1 normal, 3 control -> special added token, 4 user-defined -> added token). The pre-tokenizer follows
`tokenizer.ggml.pre`: "smollm" splits every digit before the GPT-2 byte-level regex; "llama-bpe" uses
Llama-3's split regex; anything else gets the plain GPT-2 byte-level regex.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from dlm_jax.io.checkpoint import CheckpointError

_CONTROL, _USER_DEFINED = 3, 4
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def _pre_tokenizer(pre: str | None) -> tuple[Any, str | None]:
  """(pre-tokenizer, warning or None) for GGUF's `tokenizer.ggml.pre`."""
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  if pre == "smollm":
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level]), None
  if pre == "llama-bpe":
    split = pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated", invert=False)
    return pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]), None
  warning = None if pre in (None, "gpt2", "default") else (
      f"tokenizer.ggml.pre={pre!r} is not known here; using the GPT-2 byte-level split.")
  return byte_level, warning


def build_tokenizer(meta: dict[str, Any]) -> tuple[Tokenizer, dict[str, Any], str | None]:
  """(tokenizer, tokenizer_config.json dict, warning or None) from GGUF metadata {key: value}."""
  kind = meta.get("tokenizer.ggml.model")
  if kind != "gpt2":
    raise CheckpointError(f"GGUF field tokenizer.ggml.model is {kind!r}; expected 'gpt2' (byte-level BPE). "
                          "SentencePiece ('llama') tokenizers are not supported.")
  tokens = list(meta.get("tokenizer.ggml.tokens") or [])
  merges = list(meta.get("tokenizer.ggml.merges") or [])
  types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
  if not tokens or len(types) != len(tokens):
    raise CheckpointError(f"GGUF tokenizer metadata: tokenizer.ggml.tokens has {len(tokens)} entries and "
                          f"tokenizer.ggml.token_type {len(types)}; expected the same non-zero count.")
  vocab = {token: i for i, token in enumerate(tokens)}
  if len(vocab) != len(tokens):
    raise CheckpointError("GGUF field tokenizer.ggml.tokens contains duplicate tokens.")
  pairs = []
  for merge in merges:
    parts = merge.split(" ")
    if len(parts) != 2:
      raise CheckpointError(f"GGUF field tokenizer.ggml.merges has entry {merge!r}; expected 'left right'.")
    pairs.append(tuple(parts))
  tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
  pre, warning = _pre_tokenizer(meta.get("tokenizer.ggml.pre"))
  tokenizer.pre_tokenizer = pre
  tokenizer.decoder = decoders.ByteLevel()
  special = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == _CONTROL]
  user = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == _USER_DEFINED]
  tokenizer.add_special_tokens(special)
  tokenizer.add_tokens(user)

  def token(key: str) -> str | None:
    index = meta.get(f"tokenizer.ggml.{key}_token_id")
    return tokens[index] if isinstance(index, int) and 0 <= index < len(tokens) else None

  add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
  if add_bos and token("bos") is not None:
    bos = token("bos")
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])])
  else:
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
  config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": add_bos,
            "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
            "clean_up_tokenization_spaces": False}
  for key in ("bos", "eos", "unk", "pad"):
    if token(key) is not None:
      config[f"{key}_token"] = token(key)
  if meta.get("tokenizer.chat_template"):
    config["chat_template"] = meta["tokenizer.chat_template"]
  return tokenizer, config, warning
