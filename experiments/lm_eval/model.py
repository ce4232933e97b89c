"""The lm-evaluation-harness model `dlm_jax`: every checkpoint the project runs, through lm-eval's three
request types (importing this module registers it).

  lm_eval.simple_evaluate(model="dlm_jax", model_args="checkpoint=tiny-dlm,mc_num=32", tasks=[...])

model_args: `experiments.lm_eval.args`. Prompts take the checkpoint's default layout (`prompt_format=auto`,
`dlm_jax.io.prompt_layout`): the training layout for a model trained here, else plain text: BOS (when the model
has one) + the context's ids, unless the context already starts with BOS (a chat template's text); lm-eval's
`--apply_chat_template` uses the checkpoint's chat format (`experiments.common.chat`). The layout used is
logged and recorded in the results' config (`prompt_format`, `get_model_info`). Contexts are
left-truncated to max_length tokens (minus the generation length). Request types: `generation` and
`scoring` in this package.
"""

from __future__ import annotations

import dataclasses

from absl import logging
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from dlm_jax.io import prompt_layout
from dlm_jax.io.tokenizer import chat_text
from dlm_jax.session import SessionError, checkpoint_bundle
from experiments.common import chat, checkpoints, devices
from experiments.common import prompts as prompts_lib
from experiments.common.cli import UserError
from experiments.lm_eval import args as args_lib
from experiments.lm_eval import generation, scoring
from experiments.common.numerics import Numerics


def resolve_prompt_format(requested: str, model: checkpoint_bundle.Model) -> str:
  """model_args prompt_format with auto resolved by the checkpoint (`dlm_jax.io.prompt_layout`; its chat default
  is plain here: lm-eval's --apply_chat_template applies the template); training needs a recorded width."""
  chosen = prompt_layout.resolve(requested, model.directory, model.record)
  if chosen == "training" and not prompt_layout.training_prompt_width(model.record):
    raise UserError(f"model_args prompt_format=training: {model.label} has no training.json with a prompt width")
  return "plain" if chosen == "chat" else chosen


@register_model("dlm_jax")
class DlmJaxLM(LM):
  """lm-eval `LM` over a dlm_jax checkpoint. Attributes: args (`EvalArgs`), model (`checkpoint_bundle.Model`
  with weights), runtime, numerics, prompt_format (plain or training: model_args prompt_format resolved)."""

  def __init__(self, **kwargs):
    super().__init__()
    self.args = args_lib.parse(kwargs)
    try:
      runtime_settings = devices.RuntimeSettings(mesh=self.args.runtime_mesh)
    except UserError as e:
      raise UserError(f"model_args mesh={self.args.mesh}: {str(e).partition(': ')[2]}") from None
    self.runtime = devices.init_runtime(runtime_settings)
    self.numerics = Numerics(dtype=self.args.dtype)
    try:
      model = checkpoints.prepare(self.args.checkpoint, self.args.sampler, "plain")
    except SessionError as e:
      raise UserError(str(e)) from None
    if self.args.sink_token == "none" and model.sink_token != "none":
      record = dict(model.record, train_config=dict(model.record.get("train_config", {}), sink="none"))
      model = dataclasses.replace(model, record=record)
    self.prompt_format = resolve_prompt_format(self.args.prompt_format, model)
    logging.info("dlm_jax: %s prompts for %s (model_args prompt_format=%s)", self.prompt_format, model.label,
                 self.args.prompt_format)
    self.model = checkpoints.load_weights(model, self.runtime, self.numerics)
    self.warned_rolling = False

  def get_model_info(self) -> dict[str, str]:
    """What lm-eval adds to its results' config: the prompt layout used and the checkpoint."""
    return {"prompt_format": self.prompt_format, "checkpoint": self.model.directory}

  def set_mask_sinks(self, k: int) -> None:
    """Switches sink masking to K = k (>= 0) for later requests (the weights stay loaded)."""
    self.args = args_lib.parse({**{n: getattr(self.args, n) for n in self.args.given}, "mask_sinks": k})

  @property
  def sink_prefix(self) -> list[int]:
    """The extra sink token's id when the model uses one (it precedes every prompt), else []."""
    if self.model.sink_token == "none":
      return []
    return [int(self.model.record["train_config"]["sink_token_id"])]

  def _ids(self, text: str) -> list[int]:
    """BOS + the text's ids (no second BOS); without a BOS, an empty text is lm-eval's prefix token, EOS."""
    config, tokenizer = self.model.config, self.model.tokenizer
    ids = tokenizer.encode(text)
    if config.bos_token_id is not None and (not ids or ids[0] != config.bos_token_id):
      ids = [config.bos_token_id] + ids
    return ids or [config.eos_token_id]

  def _training_layout(self, ids: list[int]) -> list[int]:
    """prompt_format=training for a diffusion model: visible left pads up to the training prompt width."""
    if self.prompt_format != "training" or not self.model.diffusion:
      return ids
    width = int(self.model.record["data"]["prompt_len"])
    if len(ids) > width:
      raise UserError(f"model_args prompt_format=training: a context has {len(ids)} tokens; {self.model.label} "
                      f"was trained with prompts of at most {width}")
    return [prompts_lib.pad_id(self.model)] * (width - len(ids)) + ids

  def context_ids(self, context: str, reserve: int = 0) -> list[int]:
    """The prompt ids of a generation context: sink token, (training layout pads,) BOS and the context,
    left-truncated so that the prompt and `reserve` generated tokens fit in max_length."""
    ids = self._ids(context)
    keep = max(self.args.max_length - reserve - len(self.sink_prefix), 1)
    return self.sink_prefix + self._training_layout(ids[-keep:])

  def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) as lm-eval's HF model splits them: trailing spaces of the context
    move to the continuation, the continuation is whole[len(context):] of the joint encoding (an empty
    context is the prefix token alone: BOS, else EOS); the context is left-truncated so that both fit in
    max_length."""
    spaces = len(context) - len(context.rstrip(" "))
    if spaces:
      context, continuation = context[:-spaces], context[-spaces:] + continuation
    head = self._ids(context)
    if not context:
      continuation_ids = self.model.tokenizer.encode(continuation)
    else:
      whole = self._ids(context + continuation)
      continuation_ids = whole[len(head):] or whole[-1:]
      head = whole[:len(whole) - len(continuation_ids)]
    keep = max(self.args.max_length - len(continuation_ids), 1)
    return self._training_layout(head[-keep:]), continuation_ids

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    del disable_tqdm
    return generation.generate_until(self, requests)

  def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
    del disable_tqdm
    return scoring.loglikelihood(self, requests)

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    del disable_tqdm
    return scoring.loglikelihood_rolling(self, requests)

  @property
  def tokenizer_name(self) -> str:
    return self.model.directory.replace("/", "__")

  def _chat_format(self) -> chat.ChatFormat:
    return chat.chat_format(self.model.directory, self.model.sampler)

  def chat_template(self, chat_template: bool | str = False) -> str:
    del chat_template
    return self._chat_format().template

  def apply_chat_template(self, chat_history, add_generation_prompt: bool = True) -> str:
    """The chat text of lm-eval's messages in the checkpoint's chat format (special tokens as text)."""
    form = self._chat_format()
    if form.template in ("dream", "chatml"):
      return chat_text(chat_history, "dream", add_generation_prompt=add_generation_prompt, system=form.system)
    config = self.model.config
    bos = None if config.bos_token_id is None else self.model.tokenizer.id_to_token(config.bos_token_id)
    return chat_text(chat_history, form.template, add_generation_prompt=add_generation_prompt, bos=bos)
