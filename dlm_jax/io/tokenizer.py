"""Tokenizers (Hugging Face `tokenizers` library) and the chat templates of the supported models.

`Tokenizer.from_dir(directory)` reads `tokenizer.json` (LLaDA, MMaDA, LLaMA-3, Qwen2.5 fast files) or,
when absent, Dream's slow-tokenizer files `vocab.json` + `merges.txt` (a Qwen2 byte-level BPE: NFC,
Qwen2's split regex, byte-level mapping), whose added tokens come from `tokenizer_config.json`
(`added_tokens_decoder`) or `added_tokens.json`. Special ids come from the model config (the converted
directory's `config.json`, or the config passed in).

Chat templates (`reference/models.md` §2.6, §3.7, §4.4 and Meta's Llama-3 template), as plain string
builders over messages [{"role": ..., "content": ...}]:
  * llada:  BOS, then per user/assistant message `<|start_header_id|>ROLE<|end_header_id|>\\n\\n` +
            content.strip() + `<|eot_id|>`; system messages are dropped; generation prompt
            `<|start_header_id|>assistant<|end_header_id|>\\n\\n`, otherwise EOS is appended.
  * mmada:  BOS, then per message `<|start_header_id|>ROLE<|end_header_id|>\\n` + content + `<|eot_id|>`
            (one newline); generation prompt `<|start_header_id|>assistant<|end_header_id|>\\n`.
  * dream:  ChatML; a leading system message, else "You are a helpful assistant.":
            `<|im_start|>ROLE\\ncontent<|im_end|>\\n` per message; generation prompt `<|im_start|>assistant\\n`.
  * llama3: `<|begin_of_text|>`, then per message `<|start_header_id|>ROLE<|end_header_id|>\\n\\n` +
            content.strip() + `<|eot_id|>`; generation prompt as LLaDA's.
  * ling:   LLaDA-MoE / LLaDA2.x (the Ling tokenizer; models_2026.md §2.6): per message
            `<role>ROLE</role>` + content + `<|role_end|>` with ROLE = SYSTEM, HUMAN or ASSISTANT; generation
            prompt `<role>ASSISTANT</role>`. No system turn is added (whether the hub template adds a
            default one is UNVERIFIED; dInfer's benchmark passes "detailed thinking off" itself).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Literal

import numpy as np
import tokenizers
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers

from dlm_jax.io import json_files
from dlm_jax.config import ConfigError, ModelConfig
from dlm_jax.io.errors import CheckpointError

ChatTemplate = Literal["llada", "mmada", "dream", "llama3", "ling"]
_LING_ROLES = {"system": "SYSTEM", "user": "HUMAN", "assistant": "ASSISTANT"}
Message = dict[str, str]

DREAM_DEFAULT_SYSTEM = "You are a helpful assistant."
QWEN2_SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                       r"|\s*[\r\n]+|\s+(?!\S)|\s+")

_DEFAULT_BOS = {"llada": "<|startoftext|>", "mmada": "<|startoftext|>", "llama3": "<|begin_of_text|>"}
_DEFAULT_EOS = {"llada": "<|endoftext|>", "mmada": "<|endoftext|>", "llama3": "<|end_of_text|>"}


def chat_text(messages: Sequence[Message], template: ChatTemplate, *, add_generation_prompt: bool = True,
              bos: str | None = None, eos: str | None = None, system: str = DREAM_DEFAULT_SYSTEM) -> str:
  """The chat-formatted prompt text of `messages` (module docstring); special tokens appear as text.

  bos / eos override the BOS / EOS strings (defaults: LLaDA/MMaDA `<|startoftext|>` / `<|endoftext|>`,
  Llama-3 `<|begin_of_text|>` / `<|end_of_text|>`); `system` is Dream's default system prompt.
  """
  for message in messages:
    if not {"role", "content"} <= set(message):
      raise ValueError(f"Chat messages need 'role' and 'content', got {message!r}.")
  if template == "dream":
    parts = []
    rest = list(messages)
    if not rest or rest[0]["role"] != "system":
      parts.append(f"<|im_start|>system\n{system}<|im_end|>\n")
    for message in rest:
      parts.append(f"<|im_start|>{message['role']}\n{message['content']}<|im_end|>\n")
    if add_generation_prompt:
      parts.append("<|im_start|>assistant\n")
    return "".join(parts)
  if template == "ling":
    parts = [f"<role>{_LING_ROLES[m['role']]}</role>{m['content']}<|role_end|>" for m in messages]
    if add_generation_prompt:
      parts.append("<role>ASSISTANT</role>")
    return "".join(parts)
  if template not in ("llada", "mmada", "llama3"):
    raise ValueError(f"Unknown chat template {template!r}; choose llada, mmada, dream, llama3 or ling.")
  newlines = "\n" if template == "mmada" else "\n\n"
  parts = [_DEFAULT_BOS[template] if bos is None else bos]
  for message in messages:
    if template == "llada" and message["role"] not in ("user", "assistant"):
      continue
    content = message["content"] if template == "mmada" else message["content"].strip()
    parts.append(f"<|start_header_id|>{message['role']}<|end_header_id|>{newlines}{content}<|eot_id|>")
  if add_generation_prompt:
    parts.append(f"<|start_header_id|>assistant<|end_header_id|>{newlines}")
  elif template == "llada":
    parts.append(_DEFAULT_EOS[template] if eos is None else eos)
  return "".join(parts)


def _added_tokens(directory: str) -> list[tuple[int, str, bool]]:
  """[(id, content, special)] from tokenizer_config.json's added_tokens_decoder or added_tokens.json."""
  config_path = os.path.join(directory, "tokenizer_config.json")
  if os.path.exists(config_path):
    decoder = json_files.read_json(config_path, CheckpointError).get("added_tokens_decoder") or {}
    if decoder:
      try:
        return sorted((int(i), t["content"], bool(t.get("special", True))) for i, t in decoder.items())
      except (AttributeError, KeyError, TypeError, ValueError):
        raise CheckpointError(f"{config_path}: 'added_tokens_decoder' must map token ids to objects with a "
                              "'content' string") from None
  added_path = os.path.join(directory, "added_tokens.json")
  if os.path.exists(added_path):
    added = json_files.read_json(added_path, CheckpointError)
    if not all(isinstance(c, str) and isinstance(i, int) and not isinstance(i, bool) for c, i in added.items()):
      raise CheckpointError(f"{added_path}: expected an object of token text -> integer id")
    return sorted((i, content, True) for content, i in added.items())
  return []


def byte_level_bpe(vocab_path: str, merges_path: str) -> tokenizers.Tokenizer:
  """A Qwen2-style byte-level BPE (NFC, Qwen2 split regex, byte-level) from vocab.json + merges.txt."""
  tokenizer = tokenizers.Tokenizer(models.BPE.from_file(vocab_path, merges_path))
  tokenizer.normalizer = normalizers.NFC()
  tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(tokenizers.Regex(QWEN2_SPLIT_PATTERN), behavior="isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tokenizer.decoder = decoders.ByteLevel()
  return tokenizer


def _config_from_dir(directory: str) -> ModelConfig | None:
  path = os.path.join(directory, "config.json")
  if not os.path.exists(path):
    return None
  with open(path, encoding="utf-8") as f:
    try:
      return ModelConfig.from_json(f.read())
    except (ConfigError, ValueError, TypeError):
      return None


class Tokenizer:
  """A `tokenizers.Tokenizer` plus the model's special ids.

  Attributes:
    backend: the `tokenizers.Tokenizer`.
    mask_token_id, eos_token_id, eot_token_id, bos_token_id, pad_token_id: ids (from the config) or None.
  """

  def __init__(self, backend: tokenizers.Tokenizer, config: ModelConfig | None = None):
    self.backend = backend
    for name in ("mask_token_id", "eos_token_id", "eot_token_id", "bos_token_id", "pad_token_id"):
      setattr(self, name, None if config is None else getattr(config, name))

  @classmethod
  def from_dir(cls, directory: str, config: ModelConfig | None = None) -> Tokenizer:
    """Loads tokenizer.json, or vocab.json + merges.txt (+ added tokens); special ids from `config` or
    the directory's config.json."""
    json_path = os.path.join(directory, "tokenizer.json")
    if os.path.exists(json_path):
      try:
        backend = tokenizers.Tokenizer.from_file(json_path)
      except Exception as e:  # pylint: disable=broad-except  (the Rust library raises plain Exception)
        raise CheckpointError(f"{json_path}: not a readable tokenizer file ({str(e).splitlines()[0]})") from None
    else:
      vocab, merges = os.path.join(directory, "vocab.json"), os.path.join(directory, "merges.txt")
      if not (os.path.exists(vocab) and os.path.exists(merges)):
        raise FileNotFoundError(f"No tokenizer in {directory}: expected tokenizer.json or vocab.json + merges.txt.")
      try:
        backend = byte_level_bpe(vocab, merges)
      except Exception as e:  # pylint: disable=broad-except  (the Rust library raises plain Exception)
        raise CheckpointError(f"{vocab} / {merges}: not a readable BPE vocabulary ({str(e).splitlines()[0]})") from None
      for token_id, content, special in _added_tokens(directory):
        if backend.token_to_id(content) is not None:
          continue
        expected = backend.get_vocab_size(with_added_tokens=True)
        if token_id != expected:
          raise ValueError(f"Added token {content!r} has id {token_id}, but the next free id is {expected}; "
                           "added tokens must follow the vocabulary without gaps.")
        token = AddedToken(content, special=special, normalized=False)
        (backend.add_special_tokens if special else backend.add_tokens)([token])
    return cls(backend, config if config is not None else _config_from_dir(directory))

  @classmethod
  def exists_in(cls, directory: str) -> bool:
    """True when `directory` holds tokenizer files."""
    return os.path.exists(os.path.join(directory, "tokenizer.json")) or (
        os.path.exists(os.path.join(directory, "vocab.json")) and os.path.exists(os.path.join(directory, "merges.txt")))

  @property
  def vocab_size(self) -> int:
    return self.backend.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
    """Token ids of `text`; special tokens written in the text are recognised."""
    return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  def token_to_id(self, token: str) -> int | None:
    return self.backend.token_to_id(token)

  def id_to_token(self, token_id: int) -> str | None:
    return self.backend.id_to_token(int(token_id))

  def apply_chat_template(self, messages: Sequence[Message], template: ChatTemplate, *,
                          add_generation_prompt: bool = True) -> list[int]:
    """Token ids of the chat-formatted `messages`; BOS / EOS strings follow this tokenizer's special ids."""
    bos = None if self.bos_token_id is None else self.id_to_token(self.bos_token_id)
    eos = None if self.eos_token_id is None else self.id_to_token(self.eos_token_id)
    text = chat_text(messages, template, add_generation_prompt=add_generation_prompt, bos=bos, eos=eos)
    return self.encode(text)

  def left_pad(self, sequences: Sequence[Sequence[int]], pad_id: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Left-pads id lists to one length: (ids [B, L] int32, mask [B, L] int32, 1 = real token)."""
    pad = self.pad_token_id if pad_id is None else pad_id
    if pad is None:
      raise ValueError("left_pad needs a pad id (config pad_token_id or pad_id).")
    return left_pad(sequences, pad)


def left_pad(sequences: Sequence[Sequence[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
  """Left-pads id lists to their maximum length: (ids [B, L] int32, mask [B, L] int32)."""
  length = max(len(s) for s in sequences)
  ids = np.full((len(sequences), length), pad_id, np.int32)
  mask = np.zeros((len(sequences), length), np.int32)
  for row, seq in enumerate(sequences):
    if len(seq):
      ids[row, length - len(seq):] = seq
      mask[row, length - len(seq):] = 1
  return ids, mask
