"""Which layout a checkpoint's text prompts take by default: one rule for every entry point.

`experiments.generate`, the analysis binaries (`experiments.common.checkpoints.prepare`), the lm-eval model
`dlm_jax` and the library's prompt helpers (`dlm_jax.tasks.evaluation.complete`) all resolve
`prompt_format=auto` with `default_layout`, from what the checkpoint directory records:

1. `training` when its training.json records a training prompt width (`data.prompt_len`: the embedded
   models, anything `experiments.train` wrote): `[PAD … BOS question]` of that width for a diffusion model,
   `[BOS question]` for a causal one — the only layout such a model has seen;
2. else `chat` when it records a chat template (tokenizer_config.json's `chat_template`, else
   chat_template.jinja): an instruct model converted from the hub;
3. else `plain`: BOS (when the model has one) + the text, as a base model is prompted.

An explicit format always wins; every run records the layout it used (generate's and the analysis binaries'
JSON: `prompt_format`; lm-eval: `prompt_format` in its results' config and the logged model args). In
lm-eval, `chat` is the harness's own `--apply_chat_template`: the model lays a context out as `plain`
then (a chat-templated context already starts with BOS).
"""

from __future__ import annotations

import json
import os
from typing import Any

from dlm_jax.io import json_files
from dlm_jax.io.errors import CheckpointError

LAYOUTS = ("training", "chat", "plain")
"""The layouts `default_layout` chooses among (generate also has `raw`, the tokenizer's ids alone)."""


def training_record(directory: str) -> dict[str, Any]:
  """The checkpoint's training.json ({} when absent)."""
  path = os.path.join(directory, "training.json")
  if not os.path.isfile(path):
    return {}
  return json_files.read_json(path, CheckpointError)


def training_prompt_width(record: dict[str, Any]) -> int | None:
  """The training prompt width a training record holds (`data.prompt_len`), or None."""
  width = record.get("data", {}).get("prompt_len") if isinstance(record.get("data"), dict) else None
  return int(width) if width else None


def recorded_chat_template(directory: str) -> str | None:
  """The jinja chat template of the checkpoint's tokenizer_config.json, else its chat_template.jinja, or None."""
  path = os.path.join(directory, "tokenizer_config.json")
  template = None
  if os.path.isfile(path):
    try:
      with open(path, encoding="utf-8") as f:
        template = json.load(f).get("chat_template")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
      template = None
  jinja = os.path.join(directory, "chat_template.jinja")
  if not isinstance(template, str) and os.path.isfile(jinja):
    try:
      with open(jinja, encoding="utf-8") as f:
        template = f.read()
    except (OSError, UnicodeDecodeError):
      template = None
  return template if isinstance(template, str) else None


def default_layout(directory: str, record: dict[str, Any] | None = None) -> str:
  """training, chat or plain for the checkpoint in `directory` (module docstring); `record`: its training.json
  when already read."""
  record = training_record(directory) if record is None else record
  if training_prompt_width(record):
    return "training"
  if recorded_chat_template(directory):
    return "chat"
  return "plain"


def resolve(requested: str, directory: str, record: dict[str, Any] | None = None) -> str:
  """`requested` with auto replaced by `default_layout`."""
  return default_layout(directory, record) if requested == "auto" else requested
