"""Qwen3 and the diffusion LMs stored in its layout -> `ModelConfig` fields (reference/small_dlms.md).

  arch        model_type / architectures                  attention           logits   mask id
  qwen3       qwen3 / Qwen3ForCausalLM                    causal              shifted  none
  a2d-qwen3   a2d-qwen3 / A2DQwen3LMHeadModel (dllm A2D,  bidirectional       own      tokenizer's <|mask|>,
              Tiny-A2D MDLM and BD3LM, TIDE students)     or block-causal              else 151669
  a2d-qwen2   a2d-qwen2 / A2DQwen2LMHeadModel             as a2d-qwen3        own      tokenizer, else 151665
  sdar        sdar / SDARForCausalLM                      block-causal        own      config, else 151669

Every one is the Qwen3 forward (per-head q/k RMSNorm before RoPE, head_dim its own field, tied or untied
head; a2d-qwen2: Qwen2's q/k/v biases and no q/k norm). How each declares its attention (§1, §3.5, §5.2):
  * SDAR: config.json `block_size` (4 when absent, as SGLang assumes) — block-causal on the absolute grid.
  * dllm A2D: nothing in config.json. The model itself is bidirectional; the BD3LM sampler (and TIDE, a
    BD3LM fine-tune) makes it block-causal with blocks of 32. MDLM and BD3LM checkpoints cannot be told apart
    from their files, so the block size comes from `block_size` (0 = bidirectional), else from the
    checkpoint's name (`names`: "bd3lm" or "tide" in it -> 32), else bidirectional (MDLM) with a warning.
The mask id (§2.4, §3.3): `mask_token_id` if given, else config.json's `mask_token_id`, else the tokenizer
files' mask token, else the Qwen3 tokenizer's first added token (151669; a2d-qwen2: 151665, UNVERIFIED) when
it fits the vocabulary. A stored `lm_head.weight` next to `tie_word_embeddings: true` is accepted and
ignored (the hub files of Qwen3-0.6B and Tiny-A2D store it; converters.hf_names).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from absl import logging

from dlm_jax.config import ConfigError

ARCHS = ("qwen3", "a2d-qwen3", "a2d-qwen2", "sdar")
MODEL_TYPES = {"qwen3": "qwen3", "a2d-qwen3": "a2d-qwen3", "a2d-qwen2": "a2d-qwen2", "sdar": "sdar"}
ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3", "A2DQwen3LMHeadModel": "a2d-qwen3",
                 "A2DQwen2LMHeadModel": "a2d-qwen2", "SDARForCausalLM": "sdar"}
QWEN3_MASK = 151669
"""`<|mask|>` / `<|MASK|>`: the first token added after Qwen3's 151669 (small_dlms.md §2.4)."""
QWEN2_MASK = 151665
"""The first token added after Qwen2.5's 151665 (inferred; UNVERIFIED for the Qwen2.5-Coder A2D models)."""
BD3LM_BLOCK = 32
"""dllm's BD3LM block size (Tiny-A2D bd3lm-v0.1, TIDE students): a sampler argument, not in config.json."""
SDAR_BLOCK = 4
"""SDAR's block size when config.json has no `block_size` (SGLang's and JetEngine's value)."""
MASK_NAMES = ("<|mask|>", "<|MASK|>", "<MASK>")
_BLOCK_HINTS = ("bd3lm", "tide")


@dataclasses.dataclass(frozen=True)
class Overrides:
  """What config.json cannot say about a diffusion variant.

  block_size: None = decide as the module docstring says; 0 = bidirectional; B > 0 = block-causal, blocks of B.
  mask_token_id: None = decide as the module docstring says; else this id.
  tokenizer_mask: the mask token's id found in the tokenizer files (`tokenizer_mask_id`), or None.
  names: the checkpoint's names (directory, hub repository) searched for "bd3lm" / "tide".
  """

  block_size: int | None = None
  mask_token_id: int | None = None
  tokenizer_mask: int | None = None
  names: tuple[str, ...] = ()


def checkpoint_names(hf_dir: str) -> tuple[str, ...]:
  """The directory's name, and the hub repository's ("models--org--name") in a Hugging Face cache snapshot."""
  path = os.path.normpath(os.path.abspath(hf_dir))
  names = [os.path.basename(path)]
  parent = os.path.dirname(path)
  if os.path.basename(parent) == "snapshots":
    names.append(os.path.basename(os.path.dirname(parent)))
  return tuple(names)


def _read_json(path: str) -> Any:
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (OSError, json.JSONDecodeError):
    return None


def tokenizer_mask_id(hf_dir: str) -> int | None:
  """The id of the mask token (`tokenizer_config.json`'s `mask_token`, else one of `MASK_NAMES`) in
  added_tokens.json, tokenizer_config.json's `added_tokens_decoder` or tokenizer.json's `added_tokens`;
  None when no file names one."""
  tok_config = _read_json(os.path.join(hf_dir, "tokenizer_config.json"))
  tok_config = tok_config if isinstance(tok_config, dict) else {}
  declared = tok_config.get("mask_token")
  declared = declared.get("content") if isinstance(declared, dict) else declared
  names = ((declared,) if isinstance(declared, str) else ()) + MASK_NAMES
  ids: dict[str, int] = {}
  added = _read_json(os.path.join(hf_dir, "added_tokens.json"))
  if isinstance(added, dict):
    ids.update({k: v for k, v in added.items() if isinstance(v, int)})
  decoder = tok_config.get("added_tokens_decoder")
  if isinstance(decoder, dict):
    for key, entry in decoder.items():
      if isinstance(entry, dict) and str(key).isdigit():
        ids.setdefault(entry.get("content"), int(key))
  tokenizer = _read_json(os.path.join(hf_dir, "tokenizer.json"))
  if isinstance(tokenizer, dict) and isinstance(tokenizer.get("added_tokens"), list):
    for entry in tokenizer["added_tokens"]:
      if isinstance(entry, dict) and isinstance(entry.get("id"), int):
        ids.setdefault(entry.get("content"), entry["id"])
  return next((ids[name] for name in names if name in ids), None)


def _block_size(arch: str, hf: dict[str, Any], overrides: Overrides) -> int | None:
  if overrides.block_size is not None:
    if isinstance(overrides.block_size, bool) or not isinstance(overrides.block_size, int) or overrides.block_size < 0:
      raise ConfigError(f"block_size must be 0 (bidirectional) or a positive block length, got "
                        f"{overrides.block_size!r}.")
    return overrides.block_size or None
  if arch == "sdar":
    value = hf.get("block_size")
    if value is None:
      logging.warning("config.json (sdar) has no block_size; using SDAR's %d.", SDAR_BLOCK)
      return SDAR_BLOCK
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
      raise ConfigError(f"config.json (sdar): field 'block_size' is {value!r}; expected a positive integer.")
    return value
  if any(hint in name.lower() for name in overrides.names for hint in _BLOCK_HINTS):
    logging.info("%s: the name says BD3LM; block-causal attention with blocks of %d.", overrides.names, BD3LM_BLOCK)
    return BD3LM_BLOCK
  if not any("mdlm" in name.lower() for name in overrides.names):
    logging.warning("config.json (%s) cannot tell an MDLM from a BD3LM checkpoint and the name %s says neither; "
                    "converting as MDLM (bidirectional). Pass block_size=%d for a BD3LM or TIDE model.", arch,
                    overrides.names, BD3LM_BLOCK)
  return None


def _mask_id(arch: str, hf: dict[str, Any], vocab: int, overrides: Overrides) -> int:
  default = QWEN2_MASK if arch == "a2d-qwen2" else QWEN3_MASK
  candidates = (("mask_token_id", overrides.mask_token_id), ("config.json mask_token_id", hf.get("mask_token_id")),
                ("the tokenizer's mask token", overrides.tokenizer_mask))
  for source, value in candidates:
    if value is None:
      continue
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab:
      raise ConfigError(f"{source} is {value!r}; expected a token id in [0, {vocab}).")
    return value
  if default < vocab:
    return default
  raise ConfigError(f"config.json ({arch}): no mask token id (config.json and the tokenizer files name none, and "
                    f"the default {default} is outside the vocabulary of {vocab}); pass mask_token_id.")


def qwen3_fields(arch: str, base: dict[str, Any], hf: dict[str, Any], overrides: Overrides) -> dict[str, Any]:
  """The ModelConfig fields of `arch` from `base` (the Hugging Face Llama-style fields of its config.json,
  `hf_config.hf_llama_like_fields`) and `overrides`."""
  fields = dict(base, qkv_bias=arch == "a2d-qwen2", qk_norm=arch != "a2d-qwen2")
  if arch == "qwen3":
    if overrides.block_size is not None or overrides.mask_token_id is not None:
      raise ConfigError("block_size and mask_token_id apply to the diffusion variants (a2d-qwen3, a2d-qwen2, sdar); "
                        "qwen3 is the causal language model.")
    return dict(fields, causal=True, logit_shift=1, mask_token_id=None)
  return dict(fields, causal=False, logit_shift=0, attention_block_size=_block_size(arch, hf, overrides),
              mask_token_id=_mask_id(arch, hf, fields["vocab_size"], overrides))
