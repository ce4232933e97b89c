"""Elastic-Cache's decoding as two options of LLaDA's threshold / factor decoding (`LLaDAOptions.window`,
`LLaDAOptions.eos_truncation`), as read in the official `generate_with_elastic_cache` (VILA-Lab/Elastic-Cache,
`llada/generate.py`, through its mirror yxu-dev/Elastic-Cache; facts only):

  * sliding window: a call's candidates are the first `window` still-masked positions (the official code has no
    blocks: with `block_length=None` the block is the whole generation and this is its window; with blocks, the
    first `window` masks of the current block);
  * EOS truncation: after the first call that decodes the EOS id, the still-masked positions after the first EOS
    that call decoded are never candidates again (they stay masks in the output; a later EOS cuts nothing), and
    the run ends when no candidate is left (NFE = the calls made).

The cut is a function of the tokens and `decode_step` (the call each generated position was decoded at), so
the sampler carries nothing new.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def first_masks(masked: jax.Array, window: int | None) -> jax.Array:
  """The first `window` True entries of each row of masked [B, W] bool (all of them when window is None).
  -> [B, W] bool."""
  if window is None:
    return masked
  return masked & (jnp.cumsum(masked.astype(jnp.int32), axis=-1) <= window)


def eos_cut(generated: jax.Array, decode_step: jax.Array, eos_id: int) -> jax.Array:
  """The official EOS cut of each row: generated [B, G] token ids, decode_step [B, G] int32 (the call each was
  decoded at, -1 for none). -> [B] int32, the index in [0, G) of the first EOS decoded at the earliest call that
  decoded one; G when none was."""
  g = generated.shape[-1]
  eos = (generated == eos_id) & (decode_step >= 0)
  first_call = jnp.min(jnp.where(eos, decode_step, jnp.iinfo(jnp.int32).max), axis=-1, keepdims=True)
  at_first = eos & (decode_step == first_call)
  return jnp.min(jnp.where(at_first, jnp.arange(g)[None, :], g), axis=-1).astype(jnp.int32)


def before_cut(generated: jax.Array, decode_step: jax.Array, eos_id: int) -> jax.Array:
  """[B, G] bool: the generated positions still decodable under EOS truncation (before `eos_cut`)."""
  cut = eos_cut(generated, decode_step, eos_id)
  return jnp.arange(generated.shape[-1])[None, :] < cut[:, None]
