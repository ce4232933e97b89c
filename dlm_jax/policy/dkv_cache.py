"""dKV-Cache, "decode" variant (arXiv 2505.15781; horseee/dKV-Cache): delayed K/V caching driven by decode
events, no attention statistic.

Rule, as read in `generation_utils/llada_dkv_cache_decode.py` `generate` and the attention of
`models/modeling_llada_dkv_cache_decode.py` (`preprocess_cache`), in copies of the official files (see
docs/guides/compute_policies.md for which):

* the cache is dropped at every semi-AR block start; with i the step within the block, a call is a full
  forward when i <= 1 or i mod `cache_reloading_step` == 0 (`is_full_step`); every other call is cached;
* a cached call computes (embeds, runs through every layer, reads logits of) only the positions that were
  still [MASK] in the *previous call's* input — the tokens still masked plus the tokens the previous step
  just decoded, future blocks included (`query_positions`); the others (prompt and tokens decoded two or
  more steps ago) contribute K/V from the cache, which holds each position's K/V from the last call that
  computed it: a token is recomputed once as a real token the step after it is decoded, then frozen until
  the next full call;
* the attention of a computed query reads every position (fresh K/V for the computed ones, cached for the
  rest); logits of uncomputed positions do not exist and they are never commit candidates (they hold
  decoded tokens).

What the sampler must provide: the per-call boolean "[MASK] in this call's input" [B, S] of the previous
call (`DecodeEvents`), and the step within the block. No statistic comes from the forward.
The "greedy" variant (only positions about to be decoded plus a window) is not offered: see the guide.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp

from dlm_jax.policy.positions import ascending_positions, is_integer

FAMILIES = ("llada",)
"""The family whose decode rule is expressed here (the official LLaDA decode scripts); Dream's cache
types ("prefill" / "decoded" with shift types) are in `dlm_jax.policy.dkv_cache_dream`."""


@dataclasses.dataclass(frozen=True)
class DKVCacheSettings:
  """dKV-Cache decode's knob: cache_reloading_step, the refresh interval within a block (>= 1; 1 makes
  every call full). Default 8, the README's LLaDA decode setting (the test script's argparse default is
  2)."""

  NAME: ClassVar[str] = "dkv_cache"

  cache_reloading_step: int = 8

  def __post_init__(self):
    self.check()

  def check(self) -> None:
    """Refuse knobs out of range, in one line naming the knob."""
    if not is_integer(self.cache_reloading_step) or self.cache_reloading_step < 1:
      raise ValueError(f"dkv_cache cache_reloading_step must be an integer >= 1, "
                       f"got {self.cache_reloading_step!r}.")

  @classmethod
  def published(cls, family: str, task: str = "gsm8k") -> "DKVCacheSettings":
    """README value for LLaDA decode: cache_reloading_step 8 (the test script `--cache-steps` default is
    2). The official values do not vary by task, so any task name is accepted. family: "llada"."""
    if family not in FAMILIES:
      raise ValueError(f"dkv_cache has its decode rule for families {FAMILIES} "
                       f"(Dream's prefill/decoded cache is not expressed), got {family!r}.")
    del task
    return cls(cache_reloading_step=8)


class DecodeEvents(NamedTuple):
  """What a dKV-Cache call needs from the run so far: was_masked [B, S] bool, True where the previous
  call's input held [MASK]. Any value before a block's step 2 is never read (steps 0 and 1 are full)."""

  was_masked: jax.Array


def start(batch: int, seq_len: int) -> DecodeEvents:
  """Events before the first call: all positions marked masked (never read: step 0 is full)."""
  return DecodeEvents(jnp.ones((batch, seq_len), bool))


def record_call(tokens: jax.Array, mask_id: int) -> DecodeEvents:
  """Events after a call: tokens [B, S] int, the call's *input* canvas."""
  return DecodeEvents(tokens == mask_id)


def is_full_step(step_in_block: jax.Array, settings: DKVCacheSettings) -> jax.Array:
  """Full forward at steps 0 and 1 of a block and whenever step mod cache_reloading_step == 0
  (traced int, any shape -> bool)."""
  return (step_in_block <= 1) | (step_in_block % settings.cache_reloading_step == 0)


def query_mask(events: DecodeEvents) -> jax.Array:
  """The positions a cached call computes: [B, S] bool, those that were [MASK] in the previous call."""
  return events.was_masked


def query_positions(events: DecodeEvents, prompt_length: int) -> tuple[jax.Array, jax.Array]:
  """The computed positions of a cached call on a static budget: (indices [B, G] int32 ascending sequence
  positions, valid [B, G] bool), G = S - prompt_length, the generated positions.

  The budget holds every case: at a cached step (in-block step >= 2) every computed position lies in the
  generated part (the prompt never holds [MASK]); a prompt position holding [MASK] would be dropped.
  Padding entries (valid False) are uncomputed generated positions, ascending.
  """
  generated = query_mask(events)[:, prompt_length:]
  indices, valid = ascending_positions(generated, generated.shape[-1])
  return indices + jnp.int32(prompt_length), valid
