"""The small structs a decoding family describes one model call with (`dlm_jax.sampling.model_call.ModelCaller`).

CallInputs: the call's queries and the keys its top sinks may be chosen among. Readout: what comes back (the
logits window or hidden states; `dlm_jax.model.forward_inputs.Readout`, shared with `forward`). CacheCall: how
the call uses a KV cache, its mode explicit. Guidance: the unconditional half of classifier-free guidance.
"""

from __future__ import annotations

from typing import Literal

import jax
from flax import struct

from dlm_jax.core.attention_bias import NO_BIAS, AttentionBias
from dlm_jax.model import DecoderCall, KVCache
from dlm_jax.model.forward_inputs import Readout


@struct.dataclass
class CallInputs:
  """The queries of one model call.

  tokens: [B, T] int32 token ids; positions: [B, T] RoPE positions; query_valid: [B, T] bool, the real (not
  padding) queries, the ones the statistics sum over; key_valid: [B, S] bool, the keys the top sinks may be
  chosen among (not padding, written); bias: the call's padding `AttentionBias`; unresolved: [B, T] bool, the
  queries of the masked query group (`dlm_jax.instrument.stats.QUERY_GROUP_NAMES`), or None for those holding
  the mask token (none without a mask id); block_start, block_step: scalar int32, the sampler's current block
  (its first sequence position) and the calls it has had before this one, for a compute policy
  (`CallContext.block_start`), or None (a sampler without blocks).
  """

  tokens: jax.Array
  positions: jax.Array
  query_valid: jax.Array
  key_valid: jax.Array
  bias: AttentionBias = NO_BIAS
  unresolved: jax.Array | None = None
  block_start: jax.Array | None = None
  block_step: jax.Array | None = None


@struct.dataclass
class CacheCall:
  """A call that uses a KV cache; its mode is explicit.

  cache: the `KVCache` [L, B, S, K, H]; offset: sequence index of the call's first query (may be traced);
  sequence: [B, S] the whole sequence the intervention sees; mode: "write" — the call writes its keys and
  values at `offset` and reads all S cache positions (prefill, refresh, cached decoding) — or "decode" — a
  DiffusionGemma decoder call, which reads the cache and writes nothing; decoder: the decoder call's
  self-conditioning inputs (mode "decode" only).
  """

  cache: KVCache
  offset: jax.Array | int
  sequence: jax.Array
  mode: Literal["write", "decode"] = struct.field(pytree_node=False, default="write")
  decoder: DecoderCall | None = None

  def __post_init__(self):
    if self.mode not in ("write", "decode"):
      raise ValueError(f"CacheCall.mode must be 'write' or 'decode', got {self.mode!r}.")
    if (self.mode == "decode") != (self.decoder is not None):
      raise ValueError("CacheCall: a 'decode' call carries its DecoderCall and a 'write' call none.")


@struct.dataclass
class Guidance:
  """Classifier-free guidance's unconditional half: tokens [B, T] and their padding `AttentionBias`."""

  tokens: jax.Array
  bias: AttentionBias = NO_BIAS
