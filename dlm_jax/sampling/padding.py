"""Left-padded batches: the one helper that builds validity masks, shifted positions and padding biases.

A batch of prompts of different lengths is left-padded to [B, Lp] with a `prompt_mask` (1 = real token);
the sequence appends G generated positions, all real. Families choose, per the original code they follow:

  attention "visible": pads are ordinary tokens (no mask; the original HF LLaDA);
            "key":     pad keys are removed from every query's view (key bias; LLaDA's Oct-2025 update,
                       Hugging Face autoregressive `generate`);
            "outer":   the boolean outer product valid(i) ∧ valid(j) (Dream, MMaDA): pad queries see
                       nothing (finite, uniform rows) and real queries never see pads;
  shift_positions: RoPE positions cumsum(valid) − 1 with pads at 1 (Dream, Hugging Face `generate`), so a
            row's real tokens sit at 0, 1, … whatever its padding; otherwise 0..S−1 (LLaDA, MMaDA).

With key or outer masking and shifted positions a row's results do not depend on how much it is padded
(the batch-invariant layout); "visible" or unshifted positions make them depend on it, as in the
originals.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
from flax import struct

from dlm_jax.core.attention_bias import NO_BIAS, AttentionBias
from dlm_jax.instrument.interventions import padding_bias

PaddingAttention = Literal["visible", "key", "outer"]
PADDING_ATTENTION = ("visible", "key", "outer")


@struct.dataclass
class PaddingLayout:
  """What padding means for one run (loop invariants).

  valid: [B, S] bool, True = real token (all True without a prompt mask).
  positions: [B, S] int32 RoPE positions of the sequence.
  bias: the padding `AttentionBias` over the whole sequence (keys S, queries S).
  """

  valid: jax.Array
  positions: jax.Array
  bias: AttentionBias


def sequence_validity(prompt_mask: jax.Array | None, batch: int, total: int) -> jax.Array:
  """[B, S] bool: the prompt mask [B, Lp] (None = all real) extended with ones over the generation."""
  if prompt_mask is None:
    return jnp.ones((batch, total), bool)
  gen = jnp.ones((batch, total - prompt_mask.shape[1]), bool)
  return jnp.concatenate([prompt_mask.astype(bool), gen], axis=1)


def shifted_positions(valid: jax.Array) -> jax.Array:
  """[B, S] int32: cumsum(valid) − 1 at real tokens, 1 at pads (the Hugging Face convention)."""
  return jnp.where(valid, jnp.cumsum(valid.astype(jnp.int32), axis=1) - 1, 1).astype(jnp.int32)


def layout(prompt_mask: jax.Array | None, total: int, attention: PaddingAttention, shift_positions: bool,
           batch: int) -> PaddingLayout:
  """The `PaddingLayout` of a [batch, total] sequence whose first Lp positions follow `prompt_mask` [B, Lp].

  Without a prompt mask nothing is padded: no bias and positions 0..S−1 whatever the options.
  """
  if attention not in PADDING_ATTENTION:
    raise ValueError(f"padding attention must be one of {PADDING_ATTENTION}, got {attention!r}.")
  valid = sequence_validity(prompt_mask, batch, total)
  plain = jnp.broadcast_to(jnp.arange(total, dtype=jnp.int32), (batch, total))
  if prompt_mask is None:
    return PaddingLayout(valid=valid, positions=plain, bias=NO_BIAS)
  positions = shifted_positions(valid) if shift_positions else plain
  bias = NO_BIAS if attention == "visible" else padding_bias(valid, outer=attention == "outer")
  return PaddingLayout(valid=valid, positions=positions, bias=bias)


def query_rows(bias: AttentionBias, start: int, length: int) -> AttentionBias:
  """The bias of a call whose queries are sequence positions start..start+length−1 (its pairwise rows;
  key biases apply to every query unchanged). start: int or traced scalar; length: static int."""
  if bias.pairwise is None or bias.pairwise.shape[-2] == 1:
    return bias
  return bias.replace(pairwise=jax.lax.dynamic_slice_in_dim(bias.pairwise, start, length,
                                                            axis=bias.pairwise.ndim - 2))
