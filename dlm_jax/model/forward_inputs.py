"""The structs `dlm_jax.model.forward` takes besides params, tokens, config and positions.

CallInstruments: what the call measures and changes (the attention bias, the statistics and their query
groups, the hooks). Readout: what comes back for which positions (also a sampler's `ModelCaller` readout).
Compute: how the call computes (the attention path, the KV cache it uses, a compute policy's subset).
"""

from __future__ import annotations

from typing import Any, Literal

import jax
from flax import struct

from dlm_jax.core.attention_bias import NO_BIAS, AttentionBias
from dlm_jax.core.old_keywords import Moved
from dlm_jax.instrument.hook_call import HookCall
from dlm_jax.instrument.stats import NO_STATS, StatsSpec


@struct.dataclass
class CallInstruments:
  """What one forward call measures and changes.

  bias: `AttentionBias` added to the attention scores (key masks, pairwise masks, zero-value keys), shared by
  all layers or per layer as its flags say; its key axis S is T, or the cache length. stats_spec: which
  statistics to return (static). query_weights: [B, Q, T] query-group weights of the statistics
  (`StatsSpec.query_groups`), or None. hooks: a `dlm_jax.instrument.hook_call.HookCall` (captures and edits at
  the named sites), or None.
  """

  bias: AttentionBias = NO_BIAS
  stats_spec: StatsSpec = struct.field(pytree_node=False, default=NO_STATS)
  query_weights: jax.Array | None = None
  hooks: HookCall | None = None


@struct.dataclass
class Readout:
  """What a call returns for its positions.

  window: (start, stop) query rows whose logits are computed, "last" (the last row) or None (every row);
  offset: a traced shift of the window to (start + offset, stop + offset) (clamped into [0, T] as
  `lax.dynamic_slice` does); hidden: return the window's final-normed hidden states instead of logits
  (`dlm_jax.model.lm_head` reads any slice of them).
  """

  window: tuple[int, int] | Literal["last"] | None = struct.field(pytree_node=False, default=None)
  offset: jax.Array | int = 0
  hidden: bool = struct.field(pytree_node=False, default=False)


@struct.dataclass
class Compute:
  """How one forward call computes.

  attention_impl: "chunked" (exact, O(N·chunk·S) memory), "dense" (reference) or "fused" (static);
  query_chunk: queries per chunk of the chunked path (static); cache: a `KVCache` [L, B, S, K, H] or None;
  cache_offset: sequence index of the first query with a cache (scalar, may be traced); decoder: a
  `DecoderCall` makes the call a DiffusionGemma decoder call (needs `cache`), None an ordinary one; subset: a
  compute policy's `ComputeSubset`, or None. `forward`'s docstring says what each does.
  """

  attention_impl: str = struct.field(pytree_node=False, default="chunked")
  query_chunk: int = struct.field(pytree_node=False, default=128)
  cache: Any = None
  cache_offset: jax.Array | int = 0
  decoder: Any = None
  subset: Any = None


NO_INSTRUMENTS = CallInstruments()
FULL_READOUT = Readout()
DEFAULT_COMPUTE = Compute()

FORWARD_MOVES = {
    **{name: Moved("instruments", "CallInstruments", name) for name in ("bias", "stats_spec", "query_weights",
                                                                         "hooks")},
    "logits_window": Moved("readout", "Readout", "window"),
    "logits_offset": Moved("readout", "Readout", "offset"),
    "return_hidden": Moved("readout", "Readout", "hidden"),
    **{name: Moved("compute", "Compute", name) for name in ("attention_impl", "query_chunk", "cache", "cache_offset",
                                                            "decoder", "subset")},
}
"""`forward`'s old keywords and the struct fields they moved into."""
