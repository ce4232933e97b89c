"""The one Transformer behind every supported model, as Flax NNX modules, and its pure entry point.

token embedding → L pre-norm blocks (RMSNorm → attention with optional q/k/v bias, optional per-head QK
RMSNorm, full or partial rotate-half RoPE, GQA → residual; RMSNorm → feed-forward → residual) → final
RMSNorm → LM head (untied, or tied to the embedding). The feed-forward is a dense SwiGLU, or in a
mixture-of-experts model (`config.n_experts > 0`) a router choosing k of E SwiGLU experts per token plus
optional always-on shared experts (`MoE`), after `config.first_k_dense` leading dense layers.

The blocks are stored stacked (every block parameter has a leading layer axis) and run with `lax.scan`,
so compile time does not grow with depth. A dense model has one stack `blocks` [L]. An MoE model has
`blocks` [L − k] for its MoE layers and, when k = `first_k_dense` > 0, a second stack `dense_blocks` [k]
for the leading dense layers; the two are scanned one after the other (dense first), and everything that
is per layer outside the parameters (KV cache, per-layer biases, statistics) keeps one [L] axis in
absolute layer order. A `layer_pattern` model (Gemma 4 / DiffusionGemma) stores its sliding layers in
`blocks` [L_s] and its global layers in `global_blocks` [L_g] and runs one scan per maximal run of one
kind, in absolute order (BUILD.md decision 16); its blocks add the Gemma sandwich norms
(`post_attn_norm`, `post_ffn_norm`), the dense GeGLU `mlp` with `post_mlp_norm` in parallel with the
`moe` (`moe_norm`, `post_moe_norm`; router `moe.router.{kernel, scale, per_expert_scale}`) and
`layer_scalar` [1]; global layers without a v projection when `global_k_eq_v`; and the model has
`self_conditioning.{pre_norm.weight, mlp.*}`. Public functions take the params as a pure nested dict
(`init_params`, `forward`); the NNX modules are rebuilt from it inside the traced function.

One loop runs every layout: `layer_runs` cuts the layers into maximal runs that share a block stack and
an attention kind, and `Transformer.__call__` scans each run in absolute layer order.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dlm_jax.config import ModelConfig
from dlm_jax.instrument.forward_sites import ForwardSites
from dlm_jax.instrument.hook_call import HookCall
from dlm_jax.instrument.site_hooks import SiteHooks, at
from dlm_jax.instrument.stats import STATISTICS, ForwardOutput, LayerValues, StatsSpec
from dlm_jax.core.attention_bias import MASK_VALUE, AttentionBias
from dlm_jax.model import layer_refresh
from dlm_jax.model.attention_layer import AttentionCall
from dlm_jax.model.block import SelfConditioning, block_stack
from dlm_jax.model.cache import KVCache
from dlm_jax.model import reuse_layers
from dlm_jax.model.compute_subset import ComputeSubset
from dlm_jax.model.primitives import EMBED_INIT, RMSNorm, linear
from dlm_jax.model.rope import proportional_rope_tables, rope_tables


@dataclasses.dataclass(frozen=True)
class LayerRun:
  """Consecutive layers [start, stop) scanned over one stack of blocks.

  stack: the Transformer attribute holding the stacked blocks ("dense_blocks", "blocks", "global_blocks").
  kind: the layers' attention kind, "s" (every layer of a model whose layers are alike; the sliding layers
    of a `layer_pattern` model) or "g" (global layers): it picks the RoPE tables and the KV cache.
  stack_start: index of layer `start` in its stack; cache_start: its index in its kind's cache ([L] for a
    model whose layers are alike, [L_s] / [L_g] with a `layer_pattern`).
  """

  stack: str
  kind: str
  start: int
  stop: int
  stack_start: int
  cache_start: int


def layer_runs(config: ModelConfig) -> list[LayerRun]:
  """The model's layers as maximal runs, in absolute order: one run for a model whose layers are alike, the
  leading dense layers then the MoE layers with `first_k_dense`, one run per stretch of one kind with a
  `layer_pattern`."""
  if config.layer_pattern is None:
    k = config.first_k_dense
    runs = [LayerRun("dense_blocks", "s", 0, k, 0, 0)] if k else []
    return runs + [LayerRun("blocks", "s", k, config.n_layers, 0, k)]
  kinds, runs, seen = config.layer_kinds, [], {"s": 0, "g": 0}
  start = 0
  for i in range(1, len(kinds) + 1):
    if i == len(kinds) or kinds[i] != kinds[start]:
      kind = kinds[start]
      stack = "blocks" if kind == "s" else "global_blocks"
      runs.append(LayerRun(stack, kind, start, i, seen[kind], seen[kind]))
      seen[kind] += i - start
      start = i
  return runs


def _take(tree, start: int, n: int):
  """Leading-axis slice [start, start + n) of every array of `tree` (the arrays themselves when whole)."""
  return jax.tree.map(lambda a: a if start == 0 and a.shape[0] == n else a[start:start + n], tree)


def _concatenate(parts: list):
  """Concatenates a list of pytrees with equal structure along their leading axis."""
  return parts[0] if len(parts) == 1 else jax.tree.map(lambda *a: jnp.concatenate(a), *parts)


class ModelCall(NamedTuple):
  """What `forward` hands the `Transformer` besides tokens and positions (its arguments, checked; see there)."""

  bias: AttentionBias
  query_weights: Any
  stats_spec: StatsSpec
  logits_window: tuple[int, int] | None
  logits_offset: Any
  impl: str
  query_chunk: int
  cache: KVCache | None
  cache_offset: Any
  return_hidden: bool
  decoder: Any = None
  hooks: HookCall | None = None
  subset: ComputeSubset | None = None


class Transformer(nnx.Module):
  """Embedding, stacked blocks (`blocks`, and `dense_blocks` for an MoE model's leading dense layers, or
  `blocks` for the sliding and `global_blocks` for the global layers of a `layer_pattern` model), final
  norm, LM head, and DiffusionGemma's `self_conditioning`."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype: Any = jnp.float32):
    self.config = config
    self.embed = nnx.Embed(config.vocab_size, config.d_model, param_dtype=dtype, embedding_init=EMBED_INIT,
                           rngs=rngs)
    if config.first_k_dense:
      self.dense_blocks = block_stack(config, config.first_k_dense, False, rngs, dtype)
    if config.layer_pattern is None:
      self.blocks = block_stack(config, config.n_layers - config.first_k_dense, config.is_moe, rngs, dtype)
    else:
      self.blocks = block_stack(config, config.layer_kinds.count("s"), config.is_moe, rngs, dtype, "s")
      self.global_blocks = block_stack(config, config.n_global_layers, config.is_moe, rngs, dtype, "g")
    self.final_norm = RMSNorm(config.d_model, config.norm_eps, dtype=dtype, fp32_weight=config.norm_fp32_weight)
    if config.self_conditioning:
      self.self_conditioning = SelfConditioning(config, rngs=rngs, dtype=dtype)
    if not config.tied_embeddings:
      self.lm_head = linear(config.d_model, config.vocab_size, False, rngs, dtype)

  def __call__(self, tokens, positions, call: ModelCall) -> ForwardOutput:
    """tokens, positions [B, T]; call: the rest of `forward`'s arguments, checked. Statistics are computed only in
    the layers the spec asks for; sites only where the hooks name them."""
    c, model_call = self.config, call
    bias, query_weights, stats_spec, cache, cache_offset = (call.bias, call.query_weights, call.stats_spec,
                                                            call.cache, call.cache_offset)
    decoder, hooks, subset = call.decoder, call.hooks, call.subset
    n_keys = tokens.shape[1] if cache is None else cache.keys.shape[2]
    offset = 0 if cache is None else cache_offset
    sites = None if hooks is None else ForwardSites(hooks, c, offset=offset, n_seq=n_keys, readout=self._readout,
                                                    index=None if subset is None else subset.queries)
    model_hooks = None if sites is None else sites.model_sites()
    x = self._embed(tokens, decoder, model_hooks)
    per_layer = {name: value for name, value, each in _bias_parts(bias) if each}
    if subset is not None and subset.keys is not None:
      per_layer["key_index"] = subset.keys
    if subset is not None and subset.key_blocks is not None:
      per_layer["key_blocks"] = subset.key_blocks
    call = _LayerCall(
        config=c, stats_spec=stats_spec, tables=self._rope_tables(positions),
        structure=({"s": None, "g": None} if decoder is None
                   else _decoder_key_bias(c, n_keys, cache_offset, tokens.shape[1])),
        attention=AttentionCall(impl=model_call.impl, query_chunk=model_call.query_chunk,
                                query_weights=query_weights,
                                cache_offset=cache_offset, zero_values=bias.zero_values, subset=subset,
                                **{name: value for name, value, each in _bias_parts(bias) if not each}),
        slots=_stat_slots(c, stats_spec), emit_cache=cache is not None and decoder is None,
        sites=sites)
    buffers = {}
    if call.slots is not None:
      buffers = _stat_buffers(c, stats_spec, tokens.shape[0], n_keys, query_weights, tokens.shape[1])
    capture_buffers = {} if sites is None else sites.buffers(x)
    refreshed = None
    if subset is not None and subset.refresh is not None:
      x, ys, new_cache, refreshed, capture_buffers = layer_refresh.run_layers(
          self, call, x, per_layer, _kind_caches(c, cache), _run_layer, capture_buffers)
    elif subset is not None and subset.reuse is not None:
      x, ys, new_cache, capture_buffers = reuse_layers.run_layers(self, call, subset.reuse, x, per_layer, cache,
                                                                  capture_buffers)
    else:
      x, buffers, capture_buffers, ys, new_cache = self._run_layers(call, x, buffers, capture_buffers, per_layer,
                                                                    _kind_caches(c, cache))
    stats = buffers if call.slots is not None else ys
    window_start, offset = 0, model_call.logits_offset
    if model_call.logits_window is not None:
      start, stop = model_call.logits_window
      if isinstance(offset, int) and offset == 0:
        x, window_start = x[:, start:stop], start
      else:
        x = jax.lax.dynamic_slice_in_dim(x, start + offset, stop - start, axis=1)
        window_start = jnp.clip(start + offset, 0, tokens.shape[1] - (stop - start))
    x = self.final_norm(x)
    if model_hooks is not None:
      x = model_hooks("ln_final.hook_normalized", x, start=window_start)
    head = self.embed.embedding[...].T if c.tied_embeddings else self.lm_head.kernel[...]
    logits, hidden = (None, x) if model_call.return_hidden else (head_logits(x, head, c.final_logit_softcap), None)
    captures = {}
    if sites is not None:
      captures = sites.named(capture_buffers, model_hooks.captured)
    return ForwardOutput(logits=logits, stats=stats, cache=new_cache, hidden=hidden, captures=captures,
                         refresh=refreshed)

  def _readout(self, h: jax.Array, normalized: bool = False) -> jax.Array:
    """The final norm (unless h is `normalized` already: ln_final.hook_normalized) and the LM head on values
    h [B, T, D]: float32 logits [B, T, V] (the logit lens)."""
    c = self.config
    head = self.embed.embedding[...].T if c.tied_embeddings else self.lm_head.kernel[...]
    return head_logits(h if normalized else self.final_norm(h), head, c.final_logit_softcap)

  def _embed(self, tokens, decoder, hooks: SiteHooks | None = None) -> jax.Array:
    """Token embeddings [B, T, D] (scaled by √D with `embed_scale`; the hook_embed site), through
    DiffusionGemma's self-conditioning at a decoder call (`decoder`: a `DecoderCall` or None)."""
    c = self.config
    x = self.embed(tokens)
    if c.embed_scale:
      x = x * jnp.asarray(math.sqrt(c.d_model), x.dtype)
    x = at(hooks, "hook_embed", x)
    if decoder is None or not c.self_conditioning:
      return x
    soft = None
    if decoder.self_conditioning_logits is not None:
      table = self.embed.embedding[...]
      probs = jax.nn.softmax(decoder.self_conditioning_logits.astype(jnp.float32), axis=-1).astype(table.dtype)
      soft = jnp.einsum("btv,vd->btd", probs, table)
      if c.embed_scale:
        soft = soft * jnp.asarray(math.sqrt(c.d_model), soft.dtype)
      if decoder.self_conditioning_mask is not None:
        soft = soft * decoder.self_conditioning_mask.astype(soft.dtype)[:, None, None]
    return self.self_conditioning(x, soft)

  def _rope_tables(self, positions) -> dict[str, tuple[jax.Array, jax.Array]]:
    """(cos, sin) per attention kind: "s" for every layer of a model whose layers are alike, "g" for the
    proportional RoPE of a `layer_pattern` model's global layers."""
    c = self.config
    tables = {"s": rope_tables(positions, c.rope_dim, c.rope_theta)}
    if c.layer_pattern is not None:
      tables["g"] = proportional_rope_tables(positions, c.global_head_dim, c.global_rope_theta,
                                             c.global_rope_fraction)
    return tables

  def _run_layers(self, call: _LayerCall, x, buffers, capture_buffers, per_layer, kind_caches):
    """Every layer, one `lax.scan` per `LayerRun`: (x, statistics buffers, capture buffers, stacked per-layer
    statistics in absolute layer order, new `KVCache` or None)."""
    carry, stats_parts, cache_parts = (x, buffers, capture_buffers), [], {"s": [], "g": []}
    layer_slots = jnp.zeros((self.config.n_layers,), jnp.int32) if call.slots is None else call.slots
    for run in layer_runs(self.config):
      block_graph, block_state = nnx.split(getattr(self, run.stack))
      n = run.stop - run.start
      xs = (_take(block_state, run.stack_start, n), _take(per_layer, run.start, n),
            _take(kind_caches.get(run.kind), run.cache_start, n), _take(layer_slots, run.start, n),
            jnp.arange(run.start, run.stop, dtype=jnp.int32))
      carry, ys = jax.lax.scan(functools.partial(_scan_layer, call, run.kind, block_graph), carry, xs)
      if "cache" in ys:
        cache_parts[run.kind].append(ys.pop("cache"))
      stats_parts.append(ys)
    new_cache = None
    if call.emit_cache:
      new_cache = KVCache(*[array for kind in ("s", "g") if cache_parts[kind]
                            for array in _concatenate(cache_parts[kind])])
    return (*carry, _concatenate(stats_parts), new_cache)


@dataclasses.dataclass(frozen=True)
class _LayerCall:
  """What every layer of one forward call shares (traced arrays inside one trace; never a jit argument).

  tables: RoPE (cos, sin) per attention kind; structure: per kind, the decoder call's [1, 1, S] visible-key
  bias or None; attention: the `AttentionCall` common to every layer (the biases shared by all layers among
  them; each layer sets its own biases, key subset and statistics switch); slots: [L] int32 statistics slot of
  each layer (−1: none) when a layer subset is asked for, else None; emit_cache: the call returns the updated
  cache; sites: the call's `ForwardSites` (its hooks and capture buffers) or None.
  """

  config: ModelConfig
  stats_spec: StatsSpec
  tables: dict
  structure: dict
  attention: AttentionCall
  slots: jax.Array | None
  emit_cache: bool
  sites: ForwardSites | None = None

  def site_hooks(self, kind: str, layer, capture_buffers: dict) -> SiteHooks | None:
    """The `SiteHooks` of layer `layer` (traced int32) of attention kind `kind`, or None without hooks;
    capture_buffers: the captures of the layers run so far (read by the gates of scheduled edits)."""
    return None if self.sites is None else self.sites.layer_sites(kind, layer, capture_buffers)


def _bias_parts(bias: AttentionBias):
  """(argument name, value, per layer) of the pairwise and key biases."""
  return [("pairwise_bias", bias.pairwise, bias.pairwise_per_layer), ("key_bias", bias.keys, bias.keys_per_layer)]


def _kind_caches(config: ModelConfig, cache: KVCache | None) -> dict:
  """{kind: (keys, values)} of the cache ("g" only for a `layer_pattern` model); {} without a cache."""
  if cache is None:
    return {}
  caches = {"s": (cache.keys, cache.values)}
  if config.layer_pattern is not None:
    caches["g"] = (cache.global_keys, cache.global_values)
  return caches


def _decoder_key_bias(config: ModelConfig, n_keys: int, cache_offset, n_queries: int) -> dict:
  """Per kind, the [1, 1, S] bias of a decoder call's visible keys: cache positions before the canvas end;
  for the sliding layers of a `layer_pattern` model also after cache_offset − W."""
  key_index = jnp.arange(n_keys)
  end = cache_offset + n_queries
  visible = {"g": key_index < end, "s": key_index < end}
  if config.layer_pattern is not None:
    visible["s"] = visible["s"] & (key_index > cache_offset - config.sliding_window)
  return {kind: jnp.where(v, 0.0, MASK_VALUE).astype(jnp.float32)[None, None] for kind, v in visible.items()}


def _stat_slots(config: ModelConfig, spec: StatsSpec) -> jax.Array | None:
  """[L] int32: each layer's index among `spec.layers` (−1 when not asked for), or None without a subset."""
  if not spec.enabled or spec.layers is None:
    return None
  slot_of_layer = np.full((config.n_layers,), -1, np.int32)
  slot_of_layer[list(spec.layers)] = np.arange(len(spec.layers), dtype=np.int32)
  return jnp.asarray(slot_of_layer)


def _run_layer(call: _LayerCall, kind: str, block, h, kv_cache, layer_biases, with_stats: bool, layer,
               capture_buffers: dict):
  """One layer (its `Block`): (h [B, T, D], (keys, values) [B, S, K, H], {statistic name: this layer's value},
  {capture index: this layer's captured value}); capture_buffers: the captures of the earlier layers."""
  spec = call.stats_spec
  cos, sin = call.tables[kind]
  extra = {} if call.structure[kind] is None else {"structure_key_bias": call.structure[kind], "mode": "decode"}
  hooks = call.site_hooks(kind, layer, capture_buffers)
  attention = call.attention._replace(with_incoming=with_stats and spec.attention, with_rows=with_stats and spec.rows,
                                      **extra, **layer_biases)
  h, readings, routing = block(h, cos, sin, attention, kv_cache, hooks)
  stats = {}
  if with_stats:
    layer_values = LayerValues(incoming=readings.incoming, keys=readings.keys, values=readings.values, hidden=h,
                               queries=readings.queries, query_weights=call.attention.query_weights,
                               routing=routing, query_offset=call.attention.cache_offset,
                               n_queries=h.shape[1], per_head=spec.per_head, k=call.config.experts_per_token,
                               rows=readings.rows)
    stats = {name: STATISTICS[name].compute(layer_values) for name in spec.names}
  return h, (readings.keys, readings.values), stats, {} if hooks is None else hooks.captured


def _scan_layer(call: _LayerCall, kind: str, block_graph, carry, xs):
  """The `lax.scan` body over a run's layers: carry (h, statistics buffers, capture buffers), xs (block
  state, per-layer biases, the layer's (keys, values) cache or None, statistics slot, layer index).
  Without a layer subset the layer's statistics are scan outputs; with one they are written into the
  buffers at the layer's slot. Captures are written into their buffers at the layer's capture slot."""
  h, buffers, capture_buffers = carry
  state, layer_biases, kv_cache, slot, layer = xs
  block = nnx.merge(block_graph, state)
  if call.slots is None:
    h, kv, stats, captured = _run_layer(call, kind, block, h, kv_cache, layer_biases, call.stats_spec.enabled,
                                        layer, capture_buffers)
    capture_buffers = _write_captures(call, kind, layer, capture_buffers, captured)
    return (h, buffers, capture_buffers), {**stats, **({"cache": kv} if call.emit_cache else {})}

  def with_stats(h, buffers):
    h, kv, stats, captured = _run_layer(call, kind, block, h, kv_cache, layer_biases, True, layer, capture_buffers)
    return h, kv, {name: jax.lax.dynamic_update_index_in_dim(buffers[name], stats[name], slot, 0)
                   for name in buffers}, captured

  def without_stats(h, buffers):
    h, kv, _, captured = _run_layer(call, kind, block, h, kv_cache, layer_biases, False, layer, capture_buffers)
    return h, kv, buffers, captured

  h, kv, buffers, captured = jax.lax.cond(slot >= 0, with_stats, without_stats, h, buffers)
  capture_buffers = _write_captures(call, kind, layer, capture_buffers, captured)
  return (h, buffers, capture_buffers), ({"cache": kv} if call.emit_cache else {})


def head_logits(hidden: jax.Array, head: jax.Array, softcap: float | None = None) -> jax.Array:
  """[B, W, D] final-normed hidden states, head [D, V] -> float32 logits [B, W, V] (soft-capped to
  softcap·tanh(logits / softcap) when softcap is given)."""
  logits = jnp.einsum("btd,dv->btv", hidden, head, preferred_element_type=jnp.float32)
  if softcap is not None:
    logits = jnp.tanh(logits / softcap) * softcap
  return logits


def _stat_buffers(config: ModelConfig, spec: StatsSpec, batch: int, n_keys: int, query_weights,
                  n_queries: int) -> dict:
  """Buffers of the statistics `spec` asks for, in their `STATISTICS` layout with L' = len(spec.layers),
  filled layer by layer when a layer subset is asked for (n_queries: T, the call's queries)."""
  sizes = {"L": len(spec.layers), "B": batch, "Q": 1 if query_weights is None else query_weights.shape[1],
           "N": config.n_heads if spec.per_head else 1, "K": config.n_kv_heads, "S": n_keys,
           "k": config.experts_per_token, "T": n_queries}
  return {name: jnp.full(tuple(sizes[a] for a in STATISTICS[name].axes), STATISTICS[name].fill,
                         STATISTICS[name].dtype) for name in spec.names}


def _write_captures(call: _LayerCall, kind: str, layer, buffers: dict, captured: dict) -> dict:
  """The capture buffers after a layer (unchanged without hooks)."""
  return buffers if call.sites is None else call.sites.write(kind, layer, buffers, captured)
