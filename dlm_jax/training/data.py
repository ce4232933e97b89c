"""Training sequences from (question, answer) pairs, and a data order that depends only on (seed, step).

Layouts (ids of the tokenizer's special tokens; q = question ids, a = answer ids):

* "sft" (masked-diffusion SFT, the LLaDA convention with a fixed-width prompt region):
      [PAD … PAD BOS q] [a EOS … EOS]
       prompt: prompt_len positions,  answer: answer_len positions (EOS padding is a trained target)
  The prompt is left-padded so the answer always starts at the same position, exactly as a sampler sees
  `[prompt | gen_length masks]` at inference.
* "document" (masked-diffusion pretraining): [BOS q a EOS … EOS], seq_len positions, all of them noised.
* "ar" (next-token baselines): [BOS q a EOS PAD … PAD], seq_len positions; targets are every position
  after the first that holds a real token (the first EOS included, PAD excluded).

Every layout yields `Examples` with three aligned [N, L] arrays; losses read what they need.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Literal, Sequence

import numpy as np

Layout = Literal["sft", "document", "ar"]


@dataclasses.dataclass(frozen=True)
class SpecialIds:
  """Token ids the layouts use."""

  pad: int
  bos: int
  eos: int


@dataclasses.dataclass(frozen=True)
class Examples:
  """Tokenised training set.

  tokens: [N, L] int32 sequences.
  prompt_mask: [N, L] bool, True on prompt positions (never noised by the SFT objective).
  target_mask: [N, L] bool, True on positions that hold a real token (PAD False; the AR loss scores
    positions 1.. where this is True).
  """

  tokens: np.ndarray
  prompt_mask: np.ndarray
  target_mask: np.ndarray

  def __len__(self) -> int:
    return self.tokens.shape[0]

  @property
  def seq_len(self) -> int:
    return self.tokens.shape[1]

  def batch(self, indices: np.ndarray) -> dict[str, np.ndarray]:
    """{"tokens", "prompt_mask", "target_mask"}: [B, L] rows at `indices`."""
    return {"tokens": self.tokens[indices], "prompt_mask": self.prompt_mask[indices],
            "target_mask": self.target_mask[indices]}


def encode_examples(pairs: Sequence[tuple[str, str]], encode: Callable[[str], list[int]], layout: Layout,
                    ids: SpecialIds, *, seq_len: int, prompt_len: int | None = None) -> Examples:
  """Tokenises (prompt, answer) text pairs into one of the layouts of the module docstring.

  Args:
    pairs: (prompt text, answer text).
    encode: text -> ids without special tokens.
    layout: "sft", "document" or "ar".
    ids: pad / bos / eos ids.
    seq_len: L, the total length.
    prompt_len: width of the prompt region for "sft" (the answer region is seq_len - prompt_len).

  Raises ValueError naming the first pair that does not fit (an "sft" answer needs room for one EOS).
  """
  if layout == "sft" and (prompt_len is None or not 0 < prompt_len < seq_len):
    raise ValueError(f"layout 'sft' needs 0 < prompt_len < seq_len={seq_len}, got prompt_len={prompt_len}.")
  n = len(pairs)
  tokens = np.full((n, seq_len), ids.eos if layout != "ar" else ids.pad, np.int32)
  prompt_mask = np.zeros((n, seq_len), bool)
  target_mask = np.ones((n, seq_len), bool)
  for i, (prompt, answer) in enumerate(pairs):
    q = [ids.bos] + list(encode(prompt))
    a = list(encode(answer))
    if layout == "sft":
      if len(q) > prompt_len or len(a) + 1 > seq_len - prompt_len:
        raise ValueError(f"Pair {i} needs prompt {len(q)} / answer {len(a) + 1} positions; prompt_len="
                         f"{prompt_len}, answer region {seq_len - prompt_len}. Raise seq_len or prompt_len.")
      tokens[i, :prompt_len] = ids.pad
      tokens[i, prompt_len - len(q):prompt_len] = q
      tokens[i, prompt_len:prompt_len + len(a)] = a
      prompt_mask[i, :prompt_len] = True
      target_mask[i, :prompt_len - len(q)] = False
    else:
      row = q + a + [ids.eos]
      if len(row) > seq_len:
        raise ValueError(f"Pair {i} needs {len(row)} positions; seq_len is {seq_len}.")
      tokens[i, :len(row)] = row
      if layout == "ar":
        target_mask[i, len(row):] = False
  return Examples(tokens=tokens, prompt_mask=prompt_mask, target_mask=target_mask)


def left_padded_prompts(prompts: Sequence[str], encode: Callable[[str], list[int]], ids: SpecialIds,
                        prompt_len: int) -> np.ndarray:
  """[B, prompt_len] int32 prompts `[PAD … BOS q]`, the "sft" layout's prompt region."""
  out = np.full((len(prompts), prompt_len), ids.pad, np.int32)
  for i, prompt in enumerate(prompts):
    q = [ids.bos] + list(encode(prompt))
    if len(q) > prompt_len:
      raise ValueError(f"Prompt {i} has {len(q)} tokens; prompt_len is {prompt_len}.")
    out[i, prompt_len - len(q):] = q
  return out


def batch_indices(seed: int, step: int, batch_size: int, n_examples: int) -> np.ndarray:
  """[batch_size] example indices of training step `step` (0-based): a function of (seed, step) only.

  The stream is a sequence of epochs, each a permutation of range(n_examples) drawn from
  numpy's PCG64 seeded by (seed, epoch); step s takes stream items s·B … s·B + B − 1. A run resumed at
  step s therefore sees exactly the batches an uninterrupted run sees.
  """
  if n_examples <= 0 or batch_size <= 0:
    raise ValueError(f"Need n_examples > 0 and batch_size > 0, got {n_examples}, {batch_size}.")
  positions = step * batch_size + np.arange(batch_size)
  epochs, offsets = np.divmod(positions, n_examples)
  out = np.empty(batch_size, np.int64)
  for epoch in np.unique(epochs):
    permutation = np.random.default_rng([seed, int(epoch)]).permutation(n_examples)
    chosen = epochs == epoch
    out[chosen] = permutation[offsets[chosen]]
  return out
