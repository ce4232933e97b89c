"""Llama-architecture GGUF file -> dlm_jax converted directory (the library behind converters.gguf).

Tensors are dequantized one at a time with `gguf.quants.dequantize` (the file itself is memory-mapped by
`gguf.GGUFReader`), so peak memory is one float32 tensor. GGUF stores a tensor with dims (ne0, ne1) =
(in, out), i.e. numpy shape [out, in] like torch, so kernels are transposed as for HF checkpoints.

llama.cpp's converter permutes the rows of attn_q / attn_k for its RoPE, which rotates adjacent pairs
(2i, 2i+1) rather than HF's halves (i, i + H/2). Within each head it moves HF row i·H/2 + j (half i ∈ {0,1},
j < H/2) to row 2j + i. We undo that: view each head's H rows as [H/2, 2], swap the two axes to [2, H/2]
and flatten, which puts row 2j + i back at i·H/2 + j (`unpermute_rope_rows`).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from converters.gguf_tokenizer import build_tokenizer
from converters.plan import Piece, check_coverage, check_plan
from dlm_jax.io.checkpoint import SAFETENSORS_DTYPES, CheckpointError, SafetensorsWriter, expected_tensors, write_config
from dlm_jax.config import ConfigError, ModelConfig
from dlm_jax.io.output_dir import atomic_output_dir, check_output_dir
from dlm_jax import extras

gguf = extras.require("gguf", "gguf", "GGUF import (converters.gguf)")

OUTPUT_DTYPES = {"float32": SAFETENSORS_DTYPES["F32"], "bfloat16": SAFETENSORS_DTYPES["BF16"]}

_LAYER = {  # our per-layer name -> (GGUF name inside blk.N, transposed)
    "attn_norm.weight": ("attn_norm.weight", False), "attn.q.kernel": ("attn_q.weight", True),
    "attn.k.kernel": ("attn_k.weight", True), "attn.v.kernel": ("attn_v.weight", True),
    "attn.o.kernel": ("attn_output.weight", True), "mlp_norm.weight": ("ffn_norm.weight", False),
    "mlp.gate.kernel": ("ffn_gate.weight", True), "mlp.up.kernel": ("ffn_up.weight", True),
    "mlp.down.kernel": ("ffn_down.weight", True)}
_GLOBAL = {"embed.embedding": ("token_embd.weight", False), "final_norm.weight": ("output_norm.weight", False),
           "lm_head.kernel": ("output.weight", True)}


def unpermute_rope_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
  """Undoes llama.cpp's q/k row permutation: weight [n_heads·H, D] (rows 2j+i) -> HF order (rows i·H/2+j)."""
  rows = weight.shape[0]
  head_dim = rows // n_heads
  return weight.reshape(n_heads, head_dim // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def read_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
  """{key: python value} of every GGUF metadata field."""
  return {key: field.contents() for key, field in reader.fields.items()}


def gguf_config(meta: dict[str, Any], tensor_names: set[str], name: str) -> ModelConfig:
  """ModelConfig of a Llama-architecture GGUF file: causal, logit shift 1, HF-style RoPE."""
  arch = meta.get("general.architecture")
  if arch != "llama":
    raise ConfigError(f"GGUF field general.architecture is {arch!r}; only 'llama' is supported.")

  def field(key: str, default: Any = None) -> Any:
    value = meta.get(f"llama.{key}", default)
    if value is None:
      raise ConfigError(f"GGUF file lacks the required field llama.{key}.")
    return value

  scaling = meta.get("llama.rope.scaling.type")
  if scaling not in (None, "none"):
    raise ConfigError(f"GGUF field llama.rope.scaling.type is {scaling!r}; RoPE scaling is not supported.")
  d_model, n_heads = int(field("embedding_length")), int(field("attention.head_count"))
  head_dim = int(field("attention.key_length", d_model // n_heads))
  rope_dims = int(field("rope.dimension_count", head_dim))
  if rope_dims != head_dim:
    raise ConfigError(f"GGUF field llama.rope.dimension_count is {rope_dims}; expected the head dim {head_dim} "
                      "(partial rotary embeddings are not supported).")
  tokens = meta.get("tokenizer.ggml.tokens") or ()
  vocab = int(field("vocab_size", len(tokens) or None))

  def token(key: str) -> int | None:
    value = meta.get(f"tokenizer.ggml.{key}_token_id")
    return int(value) if value is not None and 0 <= int(value) < vocab else None

  return ModelConfig(
      name=name, d_model=d_model, n_layers=int(field("block_count")), n_heads=n_heads,
      n_kv_heads=int(field("attention.head_count_kv", n_heads)), head_dim=head_dim,
      mlp_hidden=int(field("feed_forward_length")), vocab_size=vocab,
      norm_eps=float(field("attention.layer_norm_rms_epsilon")), rope_theta=float(field("rope.freq_base", 10000.0)),
      rope_fp32=False, qkv_bias=False, tied_embeddings="output.weight" not in tensor_names, causal=True,
      logit_shift=1, eos_token_id=token("eos"), eot_token_id=token("eos") if token("eot") is None else token("eot"),
      bos_token_id=token("bos"), pad_token_id=token("padding"))


def gguf_plan(expected: dict[str, tuple[int, ...]]) -> list[Piece]:
  """Pieces filling every tensor of `expected` from GGUF names (numpy shapes, i.e. [out, in])."""
  pieces = []
  for target, shape in expected.items():
    if target.startswith("blocks."):
      source, transpose = _LAYER[target[len("blocks."):]]
      per_layer = tuple(reversed(shape[1:])) if transpose else tuple(shape[1:])
      pieces += [Piece(target, f"blk.{layer}.{source}", per_layer, layer, transpose) for layer in range(shape[0])]
    else:
      source, transpose = _GLOBAL[target]
      pieces.append(Piece(target, source, tuple(reversed(shape)) if transpose else tuple(shape), None, transpose))
  return pieces


def _dequantized(tensor: Any, shape: tuple[int, ...]) -> np.ndarray:
  try:
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
  except NotImplementedError:
    raise CheckpointError(f"GGUF tensor {tensor.name} has type {tensor.tensor_type.name}, which the gguf package "
                          "cannot dequantize.") from None
  return np.asarray(values, np.float32).reshape(shape)


def convert_gguf(gguf_path: str, out_dir: str, *, dtype: str = "float32", overwrite: bool = False,
                 progress: Callable[[str], None] | None = None) -> ModelConfig:
  """Converts a Llama-architecture GGUF file into `out_dir` (weights, config.json, tokenizer files).

  Raises:
    ConfigError: unsupported architecture or metadata (named).
    CheckpointError: unreadable file, missing/unexpected/misshapen tensors, unsupported tokenizer, or a
      non-empty `out_dir` without `overwrite`. Nothing is left in `out_dir` on error.
  """
  check_output_dir(out_dir, overwrite=overwrite, sources=(gguf_path,))
  if dtype not in OUTPUT_DTYPES:
    raise ConfigError(f"Unknown dtype {dtype!r}; expected one of {sorted(OUTPUT_DTYPES)}.")
  if not os.path.isfile(gguf_path):
    raise CheckpointError(f"GGUF file {gguf_path} not found.")
  try:
    reader = gguf.GGUFReader(gguf_path)
  except (ValueError, OSError, KeyError, IndexError) as e:
    raise CheckpointError(f"Cannot read {gguf_path} as GGUF ({type(e).__name__}: {e}); the file is truncated or "
                          "not a GGUF file.") from None
  meta = read_metadata(reader)
  tensors = {t.name: t for t in reader.tensors}
  stem = os.path.splitext(os.path.basename(gguf_path))[0]
  config = gguf_config(meta, set(tensors), name=stem)
  expected = expected_tensors(config)
  pieces = gguf_plan(expected)
  check_coverage(pieces, expected)
  check_plan(pieces, {n: tuple(int(d) for d in reversed(t.shape)) for n, t in tensors.items()}, None, gguf_path)
  tokenizer, tokenizer_config, warning = build_tokenizer(meta)
  if warning and progress:
    progress(f"warning: {warning}")
  permuted = {"attn.q.kernel": config.n_heads, "attn.k.kernel": config.n_kv_heads}
  out_dtype = OUTPUT_DTYPES[dtype]
  with atomic_output_dir(out_dir, overwrite=overwrite, sources=(gguf_path,)) as tmp:
    write_config(tmp, config)
    tokenizer.save(os.path.join(tmp, "tokenizer.json"))
    with open(os.path.join(tmp, "tokenizer_config.json"), "w") as f:
      json.dump(tokenizer_config, f, indent=2)
    specs = {name: (shape, out_dtype) for name, shape in expected.items()}
    with SafetensorsWriter(tmp, specs) as writer:
      for k, piece in enumerate(pieces):
        start = time.perf_counter()
        values = _dequantized(tensors[piece.source], piece.shape)
        heads = permuted.get(piece.target.removeprefix("blocks."))
        if heads is not None:
          values = unpermute_rope_rows(values, heads)
        values = (values.T if piece.transpose else values).astype(out_dtype)
        if piece.layer is None:
          writer.write(piece.target, values)
        else:
          writer.write(piece.target, values[None], at=(piece.layer,))
        if progress:
          kind = tensors[piece.source].tensor_type.name
          progress(f"[{k + 1}/{len(pieces)}] {piece.source} -> {piece.target} {kind} {list(piece.shape)} "
                   f"in {time.perf_counter() - start:.2f}s")
  return config
