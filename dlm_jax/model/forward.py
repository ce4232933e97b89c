"""The pure entry point of the one Transformer: `forward` over a params tree, its input checks, and the LM
head on hidden states."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct

from dlm_jax.config import ModelConfig
from dlm_jax.core.old_keywords import fold_old_keywords
from dlm_jax.instrument.hook_call import HookCall
from dlm_jax.instrument.stats import ForwardOutput, StatsSpec
from dlm_jax.model.cache import cache_shapes
from dlm_jax.model import query_buckets, reuse_layers
from dlm_jax.model.compute_subset import ComputeSubset
from dlm_jax.model.forward_inputs import (DEFAULT_COMPUTE, FORWARD_MOVES, FULL_READOUT, NO_INSTRUMENTS, CallInstruments,
                                          Compute, Readout)
from dlm_jax.model.params import Params, graphdef
from dlm_jax.model.transformer import ModelCall, head_logits


@struct.dataclass
class DecoderCall:
  """Marks a DiffusionGemma decoder call of `forward` (see its docstring) and carries its inputs.

  self_conditioning_logits: [B, T, V] logits of the previous denoising step fed to the self-conditioning
    module (a `config.self_conditioning` model); None gives the zero signal.
  self_conditioning_mask: [B] bool or None; rows set to False get the zero signal, as if no logits were
    given for them (HF `self_conditioning_mask`; a sampler's first step inside a compiled loop).
  """

  self_conditioning_logits: jax.Array | None = None
  self_conditioning_mask: jax.Array | None = None


def lm_head(params: Params, hidden: jax.Array, *, config: ModelConfig) -> jax.Array:
  """The LM head on final-normed hidden states [B, W, D] (`forward(..., readout=Readout(hidden=True))`): float32
  logits [B, W, V], the same values `forward` returns for those positions."""
  head = params["embed"]["embedding"].T if config.tied_embeddings else params["lm_head"]["kernel"]
  return head_logits(hidden, head, config.final_logit_softcap)


def _check_hooks(config: ModelConfig, hooks: HookCall | None, shape: tuple[int, int]) -> None:
  if hooks is None:
    return
  if not isinstance(hooks, HookCall):
    raise ValueError(f"CallInstruments.hooks must be None or a HookCall, got {type(hooks).__name__}.")
  hooks.hooks.check(config)
  if hooks.flags is not None and tuple(hooks.flags.shape) != shape:
    raise ValueError(f"HookCall.flags must be {list(shape)} ([B, T]; [B, S] at a subset call), got "
                     f"{list(hooks.flags.shape)}.")
  if len(hooks.values.captures) != len(hooks.hooks.captures) or len(hooks.values.edits) != len(hooks.hooks.edits):
    raise ValueError("HookCall.values must hold one CaptureValues per capture and one EditValues per edit "
                     "(build them with dlm_jax.instrument.hook_call.hook_values).")


def _check_subset(config: ModelConfig, subset: ComputeSubset | None, shape: tuple[int, int], cache,
                  stats_spec: StatsSpec) -> None:
  if subset is None:
    return
  if not isinstance(subset, ComputeSubset):
    raise ValueError(f"Compute.subset must be None or a ComputeSubset, got {type(subset).__name__}.")
  _check_key_blocks(config, subset, shape)
  if subset.queries is None:
    return
  if cache is None:
    raise ValueError("Compute.subset reads and writes a KVCache; pass Compute(cache=KVCache.zeros(config, B, S)) "
                     "(filled by a full call).")
  if config.causal or config.layer_pattern is not None or (config.attention_block_size is not None
                                                           and subset.keys is None):
    raise ValueError(f"Compute.subset needs bidirectional attention, or block-causal attention with a key subset; "
                     f"{config.name} is causal, block-causal without ComputeSubset.keys or has sliding-window layers.")
  if tuple(subset.queries.shape) != shape:
    raise ValueError(f"ComputeSubset.queries must be [B, T] = {list(shape)}, got {list(subset.queries.shape)}.")
  if subset.keys is not None and (subset.keys.ndim != 3 or subset.keys.shape[:2] != (config.n_layers, shape[0])):
    raise ValueError(f"ComputeSubset.keys must be [L, B, m] with L={config.n_layers}, B={shape[0]}, got "
                     f"{list(subset.keys.shape)}.")
  if stats_spec.routing:
    raise ValueError("Compute.subset does not run routing statistics (their positions are contiguous); leave "
                     "them off.")
  if subset.reuse is not None:
    reason = reuse_layers.check_config(config)
    if reason is not None:
      raise ValueError(f"forward(subset=ComputeSubset(reuse=...)): {reason}")
    if subset.keys is not None or stats_spec.layers is not None:
      raise ValueError("forward(subset=ComputeSubset(reuse=...)) reads every key at every layer and computes "
                       "statistics at every layer; leave ComputeSubset.keys and StatsSpec.layers None.")


def _check_key_blocks(config: ModelConfig, subset: ComputeSubset, shape: tuple[int, int]) -> None:
  """A block-sparse call (`ComputeSubset.key_blocks`) computes every position of a bidirectional model."""
  blocks = subset.key_blocks
  if blocks is None:
    if subset.queries is None:
      raise ValueError("ComputeSubset needs queries, key_blocks or both; got neither.")
    return
  if subset.queries is not None or subset.keys is not None:
    raise ValueError("ComputeSubset.key_blocks computes every position: leave queries and keys None.")
  if subset.full is not None and tuple(subset.full.shape) != shape[:1]:
    raise ValueError(f"ComputeSubset.full must be [B] with B={shape[0]}, got {list(subset.full.shape)}.")
  if config.causal or config.attention_block_size is not None or config.layer_pattern is not None:
    raise ValueError(f"ComputeSubset.key_blocks needs bidirectional attention; {config.name} is causal, "
                     "block-causal or has sliding-window layers.")
  n_blocks = -(-shape[1] // blocks.block_size)
  if blocks.index.ndim != 5 or tuple(blocks.index.shape[:4]) != (config.n_layers, shape[0], config.n_heads, n_blocks):
    raise ValueError(f"ComputeSubset.key_blocks.index must be [L, B, N, nQb, m] with L={config.n_layers}, "
                     f"B={shape[0]}, N={config.n_heads}, nQb={n_blocks}, got {list(blocks.index.shape)}.")


def _check_inputs(config, tokens, positions, bias, query_weights, stats_spec, logits_window, cache,
                  decoder: DecoderCall | None):
  if tokens.ndim != 2:
    raise ValueError(f"tokens must be [B, T] integer ids, got shape {tokens.shape}.")
  b, t = tokens.shape
  if positions is not None and positions.shape != (b, t):
    raise ValueError(f"positions must have the tokens' shape [B, T] = {(b, t)}, got {positions.shape}.")
  n_keys = t
  if cache is not None:
    shapes = cache_shapes(config, b, cache.keys.shape[2])
    got = {"s": (cache.keys, cache.values), "g": (cache.global_keys, cache.global_values)}
    for kind, expected in shapes.items():
      arrays = got[kind]
      if any(a is None or a.shape != expected for a in arrays):
        names = "keys and values" if kind == "s" else "global_keys and global_values"
        found = [None if a is None else tuple(a.shape) for a in arrays]
        raise ValueError(f"cache {names} must be [L, B, S, K, H] = {expected}, got {found[0]} and {found[1]}; "
                         "build the cache with KVCache.zeros(config, ...).")
    n_keys = cache.keys.shape[2]
  if decoder is not None and not isinstance(decoder, DecoderCall):
    raise ValueError(f"Compute.decoder must be None or a DecoderCall, got {type(decoder).__name__}.")
  self_conditioning_logits = None if decoder is None else decoder.self_conditioning_logits
  self_conditioning_mask = None if decoder is None else decoder.self_conditioning_mask
  if decoder is not None and cache is None:
    raise ValueError("Compute.decoder (a DiffusionGemma decoder call) reads the prompt from a KVCache; pass "
                     "Compute.cache (filled by a causal call) and Compute.cache_offset (the prompt length).")
  if self_conditioning_logits is not None:
    if not config.self_conditioning:
      raise ValueError("DecoderCall.self_conditioning_logits need a model with config.self_conditioning=True.")
    if self_conditioning_logits.shape != (b, t, config.vocab_size):
      raise ValueError(f"DecoderCall.self_conditioning_logits must be [B, T, V] = {(b, t, config.vocab_size)}, got "
                       f"{tuple(self_conditioning_logits.shape)}.")
  if self_conditioning_mask is not None and (self_conditioning_logits is None
                                             or self_conditioning_mask.shape != (b,)):
    raise ValueError(f"DecoderCall.self_conditioning_mask must be [B] = {(b,)} and needs self_conditioning_logits; got "
                     f"{getattr(self_conditioning_mask, 'shape', None)}.")
  stats_spec.check_model(config)
  bias.check(n_layers=config.n_layers, batch=b, n_heads=config.n_heads, n_queries=t, n_keys=n_keys)
  stats_spec.check_layers(config.n_layers)
  if stats_spec.query_groups and (query_weights is None or query_weights.shape[1] != stats_spec.query_groups):
    got = None if query_weights is None else query_weights.shape
    raise ValueError(f"StatsSpec.query_groups={stats_spec.query_groups} needs query_weights of shape "
                     f"[B, {stats_spec.query_groups}, T]; got {got}.")
  if not stats_spec.query_groups and query_weights is not None:
    raise ValueError("CallInstruments.query_weights were given but StatsSpec.query_groups is 0; set query_groups to "
                     "query_weights.shape[1].")
  if logits_window is not None:
    start, stop = logits_window
    if not 0 <= start < stop <= t:
      raise ValueError(f"Readout.window must be (start, stop) with 0 <= start < stop <= T={t}, \"last\" or None, got "
                       f"{logits_window}.")


def forward(
    params: Params,
    tokens: jax.Array,
    *,
    config: ModelConfig,
    positions: jax.Array | None = None,
    instruments: CallInstruments = NO_INSTRUMENTS,
    readout: Readout = FULL_READOUT,
    compute: Compute = DEFAULT_COMPUTE,
    **old_keywords: Any,
) -> ForwardOutput:
  """Pure forward pass of the Transformer described by `config`: full, windowed or KV-cached.

  Jit it with `config` static; the structs (`dlm_jax.model.forward_inputs`) are pytrees whose static fields
  (`CallInstruments.stats_spec`, `Readout.window` and `.hidden`, `Compute.attention_impl` and `.query_chunk`)
  compile apart (a `DecoderCall` or None likewise).

  DiffusionGemma's encoder and decoder are the same weights called two ways. Encoder: a plain call of
  the (causal) model, with a cache to keep the prompt's keys and values — `forward(prompt [B, P],
  compute=Compute(cache=KVCache.zeros(config, B, S)))` fills cache positions [0, P) (sliding layers see
  themselves and the W−1 previous positions). Decoder: `forward(canvas [B, T], compute=Compute(cache=that
  cache, cache_offset=P, decoder=DecoderCall(self_conditioning_logits=None | [B, T, V])))` attends
  bidirectionally over
  the canvas and to cache positions [0, P) (sliding layers: [P−W+1, P)); the canvas is placed at
  positions P..P+T−1 (RoPE and key index), so the cache needs S >= P + T; keys at >= P + T are hidden;
  the cache is read, never written (`ForwardOutput.cache` is None), and statistics address the S cache
  positions as keys (the prompt keys, then the canvas at [P, P+T)).

  Args:
    params: parameter tree from `init_params` or `dlm_jax.io.checkpoint`.
    tokens: [B, T] int token ids.
    config: the model configuration (static).
    positions: [B, T] int RoPE positions; default 0..T-1 (cache_offset + 0..T-1 with a cache) in every row.
    instruments: a `CallInstruments`, what the call measures and changes:
      bias: `AttentionBias` added to the attention scores (key masks, pairwise masks, zero-value keys),
        shared by all layers or per layer as its flags say. Its key axis S is T, or the cache length.
      stats_spec: which statistics to return (static).
      query_weights: [B, Q, T] query-group weights for the statistics (see `StatsSpec.query_groups`).
      hooks: a `dlm_jax.instrument.hook_call.HookCall`: captures and edits at the named sites
        (`dlm_jax.instrument.sites`), in sequence coordinates of the S keys (a cached call's queries sit at
        cache_offset; a subset call's at subset.queries, its `HookCall.flags` then [B, S] over the sequence,
        and its captures hold zeros at the positions it did not compute; under subset.reuse the sites inside
        attention and the feed-forward see each layer's recomputed positions only,
        `dlm_jax.model.reuse_layers`); None adds nothing to the program.
    readout: a `Readout`, what comes back:
      window: (start, stop) positions whose logits are computed, "last" = (T-1, T); None computes all T.
      offset: a traced int shifting the window to (start + offset, stop + offset), which must stay
        inside [0, T] (out-of-range offsets are clamped, as `lax.dynamic_slice` does); e.g. the current block
        of a semi-autoregressive sampler inside a compiled loop.
      hidden: return the final-normed hidden states of the window (`ForwardOutput.hidden`) instead of
        logits; `lm_head` turns any slice of them into logits (a sampler that chooses the positions it needs
        inside the compiled loop).
    compute: a `Compute`, how the call computes:
      attention_impl: "chunked" (exact, O(N·chunk·S) memory), "dense" (reference) or "fused".
      query_chunk: queries per chunk in the chunked path.
      cache: a `KVCache` ([L, B, S, K, H]); this call's keys and values are written at sequence positions
        cache_offset..cache_offset+T-1 and the queries attend to all S cache positions (for a causal model
        the causal mask hides the slots after each query, so unwritten slots are never seen; with
        `config.attention_block_size` each query sees the slots up to the end of its own block, so a call
        should cover whole blocks, e.g. the current block [s, e) at cache_offset=s, or hide the block's
        unwritten slots with a key bias). Biases and statistics then address the S cache positions as keys;
        values zeroed by the bias are also zero in the returned cache.
      cache_offset: sequence index of the first token (scalar, may be traced); used with `cache`.
      decoder: a `DecoderCall` makes this a DiffusionGemma decoder call (see above; needs `cache`) and
        carries its self-conditioning inputs; None (the default) is an ordinary call.
      subset: a `ComputeSubset` (a compute policy's decision; needs `cache`): the T tokens are the sequence
        positions subset.queries [B, T] (their keys and values are written there; `positions` default to
        them), each layer reads all S cache positions or its key subset, and the statistics sum over the real
        (not padded) queries; bidirectional models only, without routing statistics (hooks: see `hooks`).
        With `key_blocks` instead (SparseD, `dlm_jax.model.block_sparse_attention`) every position is a
        query, no cache is needed, and each layer's heads read only their query block's kept key blocks;
        with subset.full [B] as well, the call is the full one (no subset) when any row's entry is true.
        With subset.buckets (static query-row counts, the last T) the call runs the first queries of the
        smallest bucket holding every row's real ones and returns zeros for the other rows
        (`dlm_jax.model.query_buckets`; readout window None).
        With subset.reuse (`dlm_jax.model.reuse_layers.LayerReuse`; tokens: the whole sequence, queries:
        every position) each layer recomputes its attention and feed-forward at the positions it chooses, and
        the returned cache is a `ReuseCache` (the KV cache, the attention and feed-forward outputs, each
        layer's recomputed positions).
    **old_keywords: the keywords these structs replaced, deprecated (a DeprecationWarning): bias=,
      stats_spec=, query_weights=, hooks= (instruments' fields of the same name), logits_window=,
      logits_offset=, return_hidden= (readout's window, offset, hidden), attention_impl=, query_chunk=,
      cache=, cache_offset=, decoder=, subset= (compute's fields of the same name); see
      `dlm_jax.model.forward_inputs.FORWARD_MOVES`.

  Returns:
    `ForwardOutput`: float32 logits [B, W, V], the requested statistics in the layout of
    `dlm_jax.instrument.stats.ForwardOutput` ([L', B, Q, N', S] incoming attention), the captures by name,
    and the updated cache (None without a cache).
  """
  structs = fold_old_keywords("forward", old_keywords, FORWARD_MOVES,
                              {"instruments": instruments, "readout": readout, "compute": compute},
                              {"instruments": NO_INSTRUMENTS, "readout": FULL_READOUT, "compute": DEFAULT_COMPUTE})
  instruments, readout, compute = structs["instruments"], structs["readout"], structs["compute"]
  for name, value, kind in (("instruments", instruments, CallInstruments), ("readout", readout, Readout),
                            ("compute", compute, Compute)):
    if not isinstance(value, kind):
      raise ValueError(f"forward: {name} must be a dlm_jax.model.{kind.__name__}, got {type(value).__name__}.")
  bias, stats_spec, query_weights, hooks = (instruments.bias, instruments.stats_spec, instruments.query_weights,
                                            instruments.hooks)
  logits_window, logits_offset, return_hidden = readout.window, readout.offset, readout.hidden
  if logits_window == "last":
    logits_window = (tokens.shape[1] - 1, tokens.shape[1]) if tokens.ndim == 2 else None
  attention_impl, query_chunk, cache, cache_offset, decoder, subset = (
      compute.attention_impl, compute.query_chunk, compute.cache, compute.cache_offset, compute.decoder,
      compute.subset)
  _check_inputs(config, tokens, positions, bias, query_weights, stats_spec, logits_window, cache, decoder)
  _check_subset(config, subset, tuple(tokens.shape), cache, stats_spec)
  subset_call = subset is not None and subset.queries is not None
  _check_hooks(config, hooks, (tokens.shape[0], cache.keys.shape[2]) if subset_call else tuple(tokens.shape))
  if subset is not None and subset.full is not None:  # the full call or the block-sparse one, as a lax.cond
    call = functools.partial(forward, params, tokens, config=config, positions=positions, instruments=instruments,
                             readout=readout)
    return jax.lax.cond(jnp.any(subset.full), lambda: call(compute=compute.replace(subset=None)),
                        lambda: call(compute=compute.replace(subset=subset.replace(full=None))))
  if subset is not None and subset.buckets:  # the first queries of a bucket, as a lax.switch
    query_buckets.check_buckets(subset, tuple(tokens.shape), logits_window)
    return query_buckets.bucket_call(functools.partial(forward, params, config=config, readout=readout), tokens,
                                     positions, instruments, compute)
  if subset is not None and subset.queries is not None:
    real = subset.queries < cache.keys.shape[2]  # padded entries are no query of the statistics
    query_weights = real[:, None, :].astype(jnp.float32) if query_weights is None else query_weights * real[:, None, :]
    if positions is None:
      positions = jnp.minimum(subset.queries, cache.keys.shape[2] - 1)
  if positions is None:
    start = 0 if cache is None else cache_offset
    positions = jnp.broadcast_to(start + jnp.arange(tokens.shape[1]), tokens.shape)
  model = nnx.merge(graphdef(config), params)
  return model(tokens, positions, ModelCall(
      bias=bias, query_weights=query_weights, stats_spec=stats_spec, logits_window=logits_window,
      logits_offset=logits_offset, impl=attention_impl, query_chunk=query_chunk, cache=cache,
      cache_offset=0 if cache is None else cache_offset, return_hidden=return_hidden, decoder=decoder, hooks=hooks,
      subset=subset))
