"""Prompts of the experiment binaries: every item's prompt ids, one common width per run, batches.

Prompt formats (--prompt_format): `training` (the layout the embedded models were trained with:
`[PAD … BOS question]` of the training prompt width, after the extra sink token when the model has one;
the pads are visible tokens to a diffusion model, as in training, and masked for a causal one), `chat`
(the checkpoint's chat template, `experiments.common.chat`), `plain` (BOS + question); `auto`: the checkpoint's default
(`dlm_jax.io.prompt_layout`, the same rule in every entry point: training when it records a training prompt
width, else chat when it records a chat template, else plain).

Every prompt of a run is left-padded to the same width W — the longest prompt of the run (the training
width for `training`) — so the sequence, and with it every item's tokens and statistics, is the same
whatever the batch size and whichever items share a batch.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from dlm_jax.session.checkpoint_bundle import Model
from experiments.common import chat
from experiments.common.cli import UserError
from experiments.common.items import Item


@dataclasses.dataclass(frozen=True)
class PromptSet:
  """All prompts of a run. sequences: item id -> ids (the unpadded prompt; with visible pads the whole
  row); width: W; pad_id: the left-padding id; masked: pads are hidden (a prompt mask is passed) — False
  when pads are visible prompt tokens or no prompt of the run is padded."""

  sequences: dict[str, list[int]]
  width: int
  pad_id: int
  masked: bool


@dataclasses.dataclass
class Prompts:
  """A batch of prompts. ids: [B, W] int32 left-padded; mask: [B, W] bool (True = real token) or None;
  rows: per item, the ids a single-item run would be given (the unpadded prompt when `mask` is set, the
  whole row otherwise)."""

  ids: np.ndarray
  mask: np.ndarray | None
  rows: list[list[int]]


def pad_id(model: Model) -> int:
  config = model.config
  return config.pad_token_id if config.pad_token_id is not None else config.eos_token_id


def _question_text(model: Model, item: Item) -> str:
  if item.kind == "humaneval" and model.prompt_format == "chat":
    return ("Complete the following Python function. Reply with the whole function in one Python code "
            f"block.\n\n```python\n{item.question}```")
  return item.question


def _training_row(model: Model, item: Item) -> list[int]:
  """[BOS question] of the training layout, refused when longer than the training prompt width."""
  config, tok = model.config, model.tokenizer
  width = int(model.record["data"]["prompt_len"])
  row = ([] if config.bos_token_id is None else [config.bos_token_id]) + tok.encode(_question_text(model, item))
  if len(row) > width:
    raise UserError(f"{model.label}: item {item.id}: the prompt has {len(row)} tokens; the model was trained with "
                    f"prompts of at most {width} (training.json prompt_len)")
  return row


def encode(model: Model, items: list[Item], chat_format: chat.ChatFormat | None = None) -> PromptSet:
  """Every item's prompt in the model's prompt format (module docstring)."""
  config, tok = model.config, model.tokenizer
  pad = pad_id(model)
  if model.prompt_format == "training":
    width = int(model.record["data"]["prompt_len"])
    rows = {item.id: _training_row(model, item) for item in items}
    if not model.diffusion:
      if model.sink_token != "none":
        raise UserError(f"{model.label}: an extra sink token is supported for diffusion models only")
      return PromptSet(rows, width, pad, masked=True)
    sink = [int(model.record["train_config"]["sink_token_id"])] if model.sink_token == "front" else []
    if model.sink_token not in ("none", "front"):
      raise UserError(f"{model.label}: only a front extra sink token is supported at inference")
    full = {k: sink + [pad] * (width - len(r)) + r for k, r in rows.items()}
    return PromptSet(full, width + len(sink), pad, masked=False)
  bos = None if config.bos_token_id is None else tok.id_to_token(config.bos_token_id)
  form = chat_format or (chat.chat_format(model.directory, model.sampler) if model.prompt_format == "chat" else None)
  sequences = {}
  for item in items:
    question = _question_text(model, item)
    if model.prompt_format == "chat":
      ids = tok.encode(form.text(question, bos))
    else:
      ids = ([] if config.bos_token_id is None else [config.bos_token_id]) + tok.encode(question)
    chat.warn_unknown_tokens(tok, ids, f"{model.label} item {item.id}")
    sequences[item.id] = ids
  width = max((len(s) for s in sequences.values()), default=1)
  return PromptSet(sequences, width, pad, masked=any(len(s) < width for s in sequences.values()))


def batch(prompt_set: PromptSet, items: list[Item], rows: int) -> Prompts:
  """The prompts of `items` as a [rows, W] batch; rows past len(items) repeat the last item (padding rows,
  whose results are discarded)."""
  sequences = [prompt_set.sequences[item.id] for item in items]
  sequences += [sequences[-1]] * (rows - len(sequences))
  ids = np.full((rows, prompt_set.width), prompt_set.pad_id, np.int32)
  mask = np.zeros((rows, prompt_set.width), bool)
  for row, seq in enumerate(sequences):
    ids[row, prompt_set.width - len(seq):] = seq
    mask[row, prompt_set.width - len(seq):] = True
  return Prompts(ids, mask if prompt_set.masked else None, [list(map(int, s)) for s in sequences[:len(items)]])


def end_ids(model: Model) -> set[int]:
  """Ids that end a reply: EOS, EoT and, for chat prompts, the chat template's end-of-turn token."""
  config = model.config
  ids = {config.eos_token_id, config.eot_token_id}
  if model.prompt_format == "chat":
    ids.add(model.tokenizer.token_to_id(chat.chat_format(model.directory, model.sampler).end_of_turn))
  return {i for i in ids if i is not None}


def stop_ids(model: Model) -> set[int]:
  """Ids that end a completion: `end_ids`, and PAD for the training layout (whose answers end in EOS then
  pads)."""
  ids = end_ids(model)
  if model.prompt_format == "training" and model.config.pad_token_id is not None:
    ids.add(model.config.pad_token_id)
  return ids


def completion(model: Model, generated: np.ndarray) -> tuple[list[int], str]:
  """(ids up to the first stop id, decoded text without special tokens) of one generated row [G]."""
  row = [int(t) for t in generated]
  stops = stop_ids(model)
  cut = next((i for i, t in enumerate(row) if t in stops), len(row))
  return row[:cut], model.tokenizer.decode(row[:cut], skip_special_tokens=True)
