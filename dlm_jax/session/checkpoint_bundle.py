"""The checkpoint bundle: a converted checkpoint with everything a decoding session needs to prompt and decode
it — config, weights, tokenizer, training record, sampler and prompt layout.

`describe` checks and describes a converted directory without loading its weights (params None), so that
every setting is refused before any model work; `load_weights` then places the weights. Which names a
checkpoint entry may take (`tiny-dlm`, `smollm2`, `label=DIR`) is the binaries' business
(`experiments.common.checkpoints`); the bundle starts from a label and a directory.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dlm_jax.config import ModelConfig
from dlm_jax.io import prompt_layout
from dlm_jax.sampling import registry
from dlm_jax.session import training_record
from dlm_jax.session.errors import SessionError

SAMPLERS = ("auto",) + registry.NAMES
"""The sampler choices of a session: auto (the model's default) or a sampler's name."""

_KIND_NAMES = {"self_conditioning": "DiffusionGemma-style", "causal": "causal", "block_causal": "block-causal",
               "bidirectional": "bidirectional"}


def default_sampler(config: ModelConfig) -> str:
  """The model's default sampler (`dlm_jax.sampling.registry.default_for`): diffusion_gemma for
  DiffusionGemma-style models, ar for other causal models, block_diffusion for block-causal ones (LLaDA2.x),
  dream for shifted DLMs, llada otherwise."""
  return registry.default_for(config).name


def check_sampler(label: str, sampler: str, config: ModelConfig) -> None:
  """Refuses a sampler that does not fit the model (`registry.Sampler.fits`): its attention (causal,
  block-causal or bidirectional), its logit shift (Dream reads shifted logits, block diffusion unshifted
  ones), or a DiffusionGemma-style model (uniform-state, self-conditioning), which only its own sampler
  decodes."""
  chosen = registry.get(sampler)
  if not chosen.fits(config):
    shift = "" if chosen.logit_shift in (None, config.logit_shift) else f" with logit_shift={config.logit_shift}"
    raise SessionError(f"{label}: sampler {sampler} does not fit a {_KIND_NAMES[registry.model_kind(config)]} "
                       f"model{shift}; use {default_sampler(config)} (or auto)")


@dataclasses.dataclass
class Model:
  """A loaded checkpoint and how it is prompted and decoded.

  label: name in tables; directory: the converted directory; record: its training.json ({} if none,
  `dlm_jax.session.training_record`); sampler: llada | mmada | dream | ar | block_diffusion | diffusion_gemma;
  prompt_format: training | chat | plain; tokenizer: a `dlm_jax.io.tokenizer.Tokenizer`; params: the weights
  (None until `load_weights`).
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
    return training_record.sink_token(self.record)


def load_params(directory: str, mesh=None, dtype: Any = None):
  """(config, params) of a converted directory, placed with `param_shardings` on `mesh` if any."""
  from dlm_jax import model  # pylint: disable=import-outside-toplevel
  from dlm_jax.io import checkpoint  # pylint: disable=import-outside-toplevel
  from dlm_jax.runtime import sharding  # pylint: disable=import-outside-toplevel
  if mesh is None:
    return checkpoint.load(directory, dtype=dtype)
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  config = checkpoint.read_config(directory)
  abstract = model.abstract_params(config, jnp.float32 if dtype is None else dtype)
  try:
    shardings = sharding.param_shardings(config, mesh, abstract)
  except ValueError as e:
    raise SessionError(f"--mesh does not fit {directory}: {e}") from None
  return checkpoint.load(directory, dtype=dtype, shardings=shardings)


def describe(label: str, directory: str, sampler: str, prompt_format: str) -> Model:
  """The converted checkpoint in `directory` checked and described without loading its weights (params None):
  config, tokenizer, training record, sampler ("auto" resolved) and prompt format ("auto": the checkpoint's
  default, `dlm_jax.io.prompt_layout`; training needs a record with the prompt width)."""
  from dlm_jax.io import checkpoint  # pylint: disable=import-outside-toplevel
  from dlm_jax.io.tokenizer import Tokenizer  # pylint: disable=import-outside-toplevel
  config = checkpoint.read_config(directory)
  if not Tokenizer.exists_in(directory):
    raise SessionError(f"{directory} has no tokenizer files; the experiments need text prompts")
  record = training_record.read(directory)
  sampler = default_sampler(config) if sampler == "auto" else sampler
  check_sampler(label, sampler, config)
  prompt_format = prompt_layout.resolve(prompt_format, directory, record)
  if prompt_format == "training" and not record.get("data", {}).get("prompt_len"):
    raise SessionError(f"{label}: --prompt_format=training needs a training.json with the prompt width; use chat "
                       "or plain")
  tokenizer = Tokenizer.from_dir(directory, config)
  return Model(label, directory, config, None, tokenizer, record, sampler, prompt_format)


def load_weights(model: Model, mesh=None, dtype: Any = None) -> Model:
  """`model` with its weights loaded (in `dtype`, default the stored one) and placed on `mesh` if any."""
  config, params = load_params(model.directory, mesh, dtype)
  return dataclasses.replace(model, config=config, params=params)
