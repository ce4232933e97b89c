"""dKV-Cache on Dream (horseee/dKV-Cache `generation_utils/dream_generation_utils.py`, as read in a copy of the
official file; the README's Dream call: cache_type "decoded", cache_steps 16, shift_type "un").

Dream predicts position p from the model output at p − 1, so which positions a call caches is shifted. With
`decoded` the set a call reads from the cache is computed from the *previous* call's input canvas (the delay of
one step): with d[p] = "position p held a token (not [MASK]) in the previous call's input",

  * shift_type "un":       p is cached when d[p + 1] (the position it predicts is decoded), the last position
                           when d[0] (the index wraps);
  * shift_type "un_right": p is cached when d[p] and d[p + 1]; the last position as the one before it;
  * shift_type "right":    p is cached when d[p] (LLaDA's rule);

except at the run's call 1, which reads the set made before the loop from the initial canvas by the "un" rule
with the last position as its own d (the official code builds that first set so whatever the shift type).
Every call whose index is a multiple of `cache_steps` (the call 0 included) recomputes everything. With
`prefill` the set made before the loop (the prompt but its last position) is read at calls 1 … cache_steps − 1;
after the first reload the official loop never sets it again, so every later call is full (mirrored).

A cached call computes the positions not cached, every layer, their keys and values written to the cache; the
others are read from it (each position's keys and values as its last computing call left them). Under
"right", a masked position whose previous position is cached has no output to read its prediction from: ours
gives it zero logits (how the official call's reordered outputs are read there is UNVERIFIED).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

CACHE_TYPES = ("decoded", "prefill")
SHIFT_TYPES = ("un", "un_right", "right")


def _first_set(decoded: jax.Array) -> jax.Array:
  """The set made before the loop: [B, S] bool, p cached when d[p + 1], the last position when its own d."""
  return jnp.concatenate([decoded[:, 1:], decoded[:, -1:]], axis=1)


def cached_positions(decoded: jax.Array, shift_type: str, first: jax.Array) -> jax.Array:
  """The positions a cached call reads from the cache: [B, S] bool.

  decoded: [B, S] bool, the previous call's input held a token (not [MASK]); shift_type: a `SHIFT_TYPES` name;
  first: scalar bool, the call is the run's call 1 (the set made before the loop, by the "un" rule).
  """
  if shift_type == "un":
    later = jnp.concatenate([decoded[:, 1:], decoded[:, :1]], axis=1)
  elif shift_type == "un_right":
    pair = decoded[:, :-1] & decoded[:, 1:]
    later = jnp.concatenate([pair, pair[:, -1:]], axis=1)
  elif shift_type == "right":
    later = decoded
  else:
    raise ValueError(f"dkv_cache shift_type must be one of {', '.join(SHIFT_TYPES)}, got {shift_type!r}.")
  return jnp.where(first, _first_set(decoded), later)


def is_full_call(call: jax.Array, cache_type: str, cache_steps: int) -> jax.Array:
  """Call `call` (traced int) recomputes everything: a multiple of cache_steps; with "prefill" also every call
  after the first reload."""
  full = call % cache_steps == 0
  if cache_type == "prefill":
    full = full | (call >= cache_steps)
  return full
