"""A checkpoint's training record: the training.json a checkpoint trained here carries beside its weights.

The record says how the model was trained and therefore how it is prompted and decoded: `data.prompt_len` and
`data.seq_len` (the training prompt width and sequence length: the training prompt layout and the answer width
the binaries default to), `train_config.sink` ("none" or "front": the extra sink token it was trained with) and
`train_config.sink_token_id`. A checkpoint without the file (a converted one) has the empty record {}.
"""

from __future__ import annotations

import os
from typing import Any

from dlm_jax.io import json_files
from dlm_jax.session.errors import SessionError

FILE = "training.json"


def read(directory: str) -> dict[str, Any]:
  """The checkpoint's training.json as a dict ({} when absent); SessionError (one line) when it is not a JSON
  object."""
  path = os.path.join(directory, FILE)
  if not os.path.isfile(path):
    return {}
  return json_files.read_json(path, SessionError)


def sink_token(record: dict[str, Any]) -> str:
  """"none" or "front": the extra sink token the model was trained with."""
  return record.get("train_config", {}).get("sink", "none")


def answer_width(record: dict[str, Any]) -> int | None:
  """The training answer width (seq_len − prompt_len), or None when the record has neither."""
  data = record.get("data", {})
  if data.get("seq_len") and data.get("prompt_len"):
    return int(data["seq_len"]) - int(data["prompt_len"])
  return None
