"""The structs `dlm_jax.model.attention.attention` (and `block_sparse_attention`) take besides q, k, v and the
scale: which keys each query sees (`Visibility`), the additive bias (`dlm_jax.core.attention_bias.AttentionBias`:
pairwise [B|1, N|1, T|1, S] and per-key [B|1, N|1, S] parts), and what the call returns and how it computes it
(`AttentionComputation`). Each old keyword of `attention` is the field of its name (`ATTENTION_MOVES`; the bias's
`pairwise_bias` / `key_bias` are `AttentionBias.pairwise` / `keys`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax

from dlm_jax.core.old_keywords import Moved

AttentionImpl = Literal["dense", "chunked", "fused"]


@dataclasses.dataclass(frozen=True)
class Visibility:
  """Which keys each query sees.

  causal: query at sequence index i sees keys 0..i (sequence index = query_offset + row).
  block_size: None, or B for block-causal attention: query at sequence index i sees key j iff j // B <= i // B
    (bidirectional inside a block of B positions, causal across blocks; the grid starts at sequence index 0).
    Combined with `causal` by intersection.
  window: None, or W for sliding-window attention: query at sequence index i sees key j only if i − j < W (with
    `causal`: the W keys i−W+1..i). Combined with the other patterns by intersection.
  query_offset: sequence index of the first query (decoding with a KV cache); scalar, may be traced.
  """

  causal: bool = False
  block_size: int | None = None
  window: int | None = None
  query_offset: Any = 0


@dataclasses.dataclass(frozen=True)
class AttentionComputation:
  """What an attention call returns besides its output, and how it computes.

  query_weights: [B, Q, T] weights of the queries in each statistics group; None means one group with weight 1
    for every query.
  with_incoming: also return the incoming attention [B, Q, N, S].
  with_rows: also return the attention rows [B, T, S] (`attention`).
  impl: "dense" (reference), "chunked" (exact, O(N·chunk·S) memory) or "fused" (fused kernel plus a chunked
    log-sum-exp pass for the statistics).
  query_chunk: queries per chunk in the chunked path and in the fused path's statistics pass.
  """

  query_weights: jax.Array | None = None
  with_incoming: bool = False
  with_rows: bool = False
  impl: AttentionImpl = "chunked"
  query_chunk: int = 128


NO_VISIBILITY_LIMIT = Visibility()
DEFAULT_COMPUTATION = AttentionComputation()

ATTENTION_MOVES = {
    **{field.name: Moved("visibility", "Visibility", field.name) for field in dataclasses.fields(Visibility)},
    **{field.name: Moved("computation", "AttentionComputation", field.name)
       for field in dataclasses.fields(AttentionComputation)},
    "pairwise_bias": Moved("bias", "AttentionBias", "pairwise"), "key_bias": Moved("bias", "AttentionBias", "keys")}
"""`attention`'s old keywords: each is the field of its name, the biases the `AttentionBias` parts."""
