"""Which chat template a checkpoint uses, its end-of-turn token, and a warning for unknown tokens.

The template recorded in the converted checkpoint wins: a `chat_template` in tokenizer_config.json that
uses `<|im_start|>` is ChatML (SmolLM2 from its GGUF metadata, Qwen2.5, Dream), with the system prompt
the template itself supplies by default when it has one; one that uses `<|start_header_id|>` is the
Llama-3 family's (LLaDA, MMaDA and Llama-3 differ only in BOS and newlines, so the sampler picks among
them). Without a recorded template the sampler decides (`dlm_jax.sampling.registry`: `Sampler.chat_template`):
llada, mmada, dream (ChatML), llama3 (ar) or ling (block_diffusion: LLaDA2.x); diffusion_gemma has none
(--template names one). A recorded template with `<role>` tags is Ling's (LLaDA-MoE, LLaDA2.x).
One with Qwen3's `enable_thinking` switch is `qwen3` (Qwen3, dllm A2D, TIDE, SDAR;
reference/small_dlms.md §3.3): ChatML without a default system turn and the generation prompt
`<|im_start|>assistant\n<think>\n\n</think>\n\n` (thinking off, the default dllm's tokenizer wrapper sets and
the A2D model cards recommend). Recorded templates are read from tokenizer_config.json's `chat_template`,
else from chat_template.jinja.
"""

from __future__ import annotations

import dataclasses
import functools
import re

from absl import logging

from dlm_jax.io.prompt_layout import recorded_chat_template as recorded_template
from dlm_jax.io.tokenizer import DREAM_DEFAULT_SYSTEM, chat_text
from dlm_jax.sampling import registry
from experiments.common.cli import UserError

TEMPLATES = ("llada", "mmada", "dream", "llama3", "chatml", "ling", "qwen3")
END_OF_TURN = {"llada": "<|eot_id|>", "mmada": "<|eot_id|>", "llama3": "<|eot_id|>", "dream": "<|im_end|>",
               "chatml": "<|im_end|>", "ling": "<|role_end|>", "qwen3": "<|im_end|>"}
_CHATML_SYSTEM = re.compile(r"<\|im_start\|>system(?:\\n|\n)([^{}'\"]+?)<\|im_end\|>")


@dataclasses.dataclass(frozen=True)
class ChatFormat:
  """template: one of TEMPLATES (chatml = ChatML with `system` as the default system prompt)."""

  template: str
  system: str = DREAM_DEFAULT_SYSTEM

  @property
  def end_of_turn(self) -> str:
    return END_OF_TURN[self.template]

  def text(self, question: str, bos: str | None) -> str:
    """The prompt text of one user turn (special tokens as text)."""
    messages = [{"role": "user", "content": question}]
    if self.template == "qwen3":
      return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    if self.template in ("dream", "chatml"):
      return chat_text(messages, "dream", system=self.system)
    return chat_text(messages, self.template, bos=bos)


@functools.lru_cache(maxsize=None)
def chat_format(directory: str, sampler: str, override: str | None = None) -> ChatFormat:
  """The chat format of a checkpoint (module docstring); `override` (a TEMPLATES name) wins. Read once
  per checkpoint and sampler; refused (a one-line error) when neither the checkpoint nor the sampler has one."""
  recorded = recorded_template(directory) or ""
  if override is None and "<|im_start|>" in recorded and "enable_thinking" in recorded:
    return ChatFormat("qwen3")
  if override is None and "<|im_start|>" in recorded:
    match = _CHATML_SYSTEM.search(recorded)
    return ChatFormat("chatml", match.group(1) if match else DREAM_DEFAULT_SYSTEM)
  if override is None and "<role>" in recorded:
    return ChatFormat("ling")
  template = override or registry.get(sampler).chat_template
  if template is None:
    raise UserError(f"{directory} records no chat template and the {sampler} sampler has none of its own "
                    "(experiments.generate takes --template)")
  return ChatFormat(template)


def warn_unknown_tokens(tokenizer, ids: list[int], what: str) -> int:
  """Logs a warning when `ids` contain the tokenizer's unknown token; returns how many they contain."""
  unk = getattr(tokenizer.backend.model, "unk_token", None)
  unk_id = tokenizer.token_to_id(unk) if unk else None
  count = sum(1 for i in ids if unk_id is not None and i == unk_id)
  if count:
    logging.warning("%s: %d token(s) of the text are unknown to the tokenizer (%s); the model sees %s instead",
                    what, count, unk, unk)
  return count
