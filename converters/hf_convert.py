"""Hugging Face checkpoint directory -> dlm_jax converted directory (the library behind converters.convert).

Reads the family's config.json (converters/hf_config.py), resolves tensors through
model.safetensors.index.json or model.safetensors, checks every name, shape and dtype against the
config before writing, then streams the tensors a block at a time into stacked, transposed
safetensors shards (converters/plan.py) and copies the tokenizer files. Output goes to a temporary
directory that is renamed to `out_dir` only when everything succeeded.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import numpy as np
from absl import logging

from converters import hf_qwen3
from converters.hf_config import ARCHS, detect_arch, model_config
from converters.hf_names import (
    DG_DECODER_LAYER, DG_ENCODER_LAYER_SCALAR, diffusion_gemma_plan, hf_plan, ignored_sources)
from converters.plan import DEFAULT_CHUNK_BYTES, check_coverage, check_plan, stream_pieces
from converters.safetensors_io import SafetensorsCheckpoint
from dlm_jax.io.checkpoint import (
    DEFAULT_MAX_SHARD_BYTES, SAFETENSORS_DTYPES, CheckpointError, SafetensorsWriter, copy_tokenizer_files, expected_tensors,
    write_config)
from dlm_jax.io import json_files
from dlm_jax.config import ConfigError, ModelConfig
from dlm_jax.io.output_dir import atomic_output_dir, check_output_dir

OUTPUT_DTYPES = {"bfloat16": "BF16", "float32": "F32", "float16": "F16"}


def read_hf_config(hf_dir: str) -> dict:
  """The parsed config.json of `hf_dir`; errors name the file."""
  path = os.path.join(hf_dir, "config.json")
  if not os.path.isfile(path):
    raise CheckpointError(f"{path} not found; --hf_dir must be a Hugging Face checkpoint directory.")
  return json_files.read_json(path, ConfigError)


def check_layer_scalars(source: SafetensorsCheckpoint, n_layers: int, where: str) -> None:
  """DiffusionGemma keeps a `layer_scalar` buffer per side (buffers are not tied); our one stack has one per
  layer, so the encoder's copy must equal the decoder's. Raises CheckpointError naming the tensor."""
  for layer in range(n_layers):
    decoder = DG_DECODER_LAYER.format(layer) + "layer_scalar"
    encoder = DG_ENCODER_LAYER_SCALAR.format(layer)
    if encoder not in source.tensors:
      raise CheckpointError(f"{where}: missing tensor {encoder} (the encoder's copy of {decoder}).")
    if tuple(source.tensors[encoder].shape) != tuple(source.tensors[decoder].shape):
      raise CheckpointError(f"{where}: tensor {encoder} has shape {list(source.tensors[encoder].shape)}; expected "
                            f"{list(source.tensors[decoder].shape)} like {decoder}.")
    rows = source.tensors[decoder].shape[0]
    a = source.read_rows(decoder, 0, rows).astype(np.float32)
    b = source.read_rows(encoder, 0, rows).astype(np.float32)
    if not np.array_equal(a, b):
      raise CheckpointError(f"{where}: tensor {encoder} = {b.tolist()} differs from {decoder} = {a.tolist()}; the "
                            "encoder and decoder must share one layer scalar per layer.")


def convert(hf_dir: str, out_dir: str, *, arch: str = "auto", dtype: str = "auto", overwrite: bool = False,
            chunk_bytes: int = DEFAULT_CHUNK_BYTES, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
            progress: Callable[[str], None] | None = None, block_size: int | None = None,
            mask_token_id: int | None = None) -> ModelConfig:
  """Converts `hf_dir` into `out_dir` and returns the written `ModelConfig`.

  block_size, mask_token_id: for the Qwen3-layout diffusion variants (a2d-qwen3, a2d-qwen2, sdar) only; None
  decides from config.json, the tokenizer files and the checkpoint's name (converters.hf_qwen3), block_size 0
  means bidirectional.

  Raises:
    ConfigError: unknown arch, or a config.json field missing or unsupported (named).
    CheckpointError: missing/unexpected tensor, wrong shape or dtype, unreadable file (named), or a
      non-empty `out_dir` without `overwrite`. Nothing is left in `out_dir` on error.
  """
  check_output_dir(out_dir, overwrite=overwrite, sources=(hf_dir,))
  hf = read_hf_config(hf_dir)
  if dtype != "auto" and dtype not in OUTPUT_DTYPES:
    raise ConfigError(f"Unknown dtype {dtype!r}; expected auto or one of {sorted(OUTPUT_DTYPES)}.")
  if arch not in ("auto",) + ARCHS:
    raise ConfigError(f"Unknown arch {arch!r}; expected one of auto, {', '.join(ARCHS)}.")
  arch = detect_arch(hf) if arch == "auto" else arch
  overrides = hf_qwen3.Overrides(block_size, mask_token_id)
  if arch in hf_qwen3.ARCHS:
    overrides = dataclasses.replace(overrides, tokenizer_mask=hf_qwen3.tokenizer_mask_id(hf_dir),
                                    names=hf_qwen3.checkpoint_names(hf_dir))
  config = model_config(arch, hf, name=os.path.basename(os.path.normpath(hf_dir)), overrides=overrides)
  expected = expected_tensors(config)
  if arch == "diffusion_gemma":
    pieces = diffusion_gemma_plan(config.layer_pattern, expected)
  else:
    pieces = hf_plan(arch, expected)
  check_coverage(pieces, expected)
  with SafetensorsCheckpoint(hf_dir) as source:
    found = {n: t.shape for n, t in source.tensors.items()}
    check_plan(pieces, found, {n: t.dtype for n, t in source.tensors.items()}, hf_dir,
               ignore=ignored_sources(arch, config.tied_embeddings))
    absent = frozenset(p.source for p in pieces if p.optional and p.source not in found)
    if absent:
      logging.warning("%s: %d optional tensors are absent (e.g. %s); they are written as zeros, as the original "
                      "model initialises them.", hf_dir, len(absent), min(absent))
    if arch == "diffusion_gemma":
      check_layer_scalars(source, config.n_layers, hf_dir)
    if dtype == "auto":
      embed_source = next(p.source for p in pieces if p.target == "embed.embedding")
      out_dtype = SAFETENSORS_DTYPES[source.tensors[embed_source].dtype]
    else:
      out_dtype = np.dtype(SAFETENSORS_DTYPES[OUTPUT_DTYPES[dtype]])
    with atomic_output_dir(out_dir, overwrite=overwrite, sources=(hf_dir,)) as tmp:
      write_config(tmp, config)
      copy_tokenizer_files(hf_dir, tmp)
      specs = {name: (shape, out_dtype) for name, shape in expected.items()}
      with SafetensorsWriter(tmp, specs, max_shard_bytes=max_shard_bytes) as writer:
        stream_pieces(pieces, source.read_rows, writer, out_dtype,
                      row_bytes=lambda name: source.tensors[name].row_bytes, chunk_bytes=chunk_bytes,
                      progress=progress, absent=absent)
  return config
