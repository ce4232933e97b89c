"""The instrument side of one forward call: the `SiteHooks` of each layer and the buffers its captures are
kept in, so that the model only calls sites (`dlm_jax.instrument.site_hooks.at`) and hands buffers along.

A per-layer capture is kept in one zero buffer per attention kind ("s", "g"), [L_k, ...] over the capture's
layers of that kind, written at the layer's slot inside the model's `lax.scan` over layers; model-level
captures (`sites.MODEL_SITES`) come back from the model-level `SiteHooks`. `named` turns both into the
`ForwardOutput.captures` dict, by captured array name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from dlm_jax.config import ModelConfig
from dlm_jax.instrument import sites
from dlm_jax.instrument.hook_call import HookCall
from dlm_jax.instrument.site_hooks import SiteHooks, reduce_capture, slot_table


def _key(index: int, kind: str) -> str:
  return f"{index}/{kind}"


@dataclasses.dataclass(frozen=True)
class ForwardSites:
  """The hooks of one forward call (traced arrays inside one trace; never a jit argument).

  hooks: the call's `HookCall`; offset: sequence position of the call's first query (traced int); n_seq: S,
  the sequence positions of captures; readout(h, normalized) -> float32 logits [B, T, V]: final norm + LM
  head (the logit lens); index: [B, T] int32 the sequence positions of the call's queries when they are not
  contiguous (a compute policy's subset call, `ComputeSubset.queries`; padded with S), else None; kept: [B, T]
  bool, the queries whose captures are kept (a layer refresh's full layer: the positions the layer computes
  for each row), or None (all).
  """

  hooks: HookCall
  config: ModelConfig
  offset: Any
  n_seq: int
  readout: Callable[..., jax.Array]
  index: jax.Array | None = None
  kept: jax.Array | None = None

  def model_sites(self) -> SiteHooks:
    """The `SiteHooks` of the model-level sites (embedding, final norm)."""
    return SiteHooks(self.hooks, self.config, kind=None, layer=None, offset=self.offset, n_seq=self.n_seq,
                     readout=self.readout, index=self.index, kept=self.kept)

  def layer_sites(self, kind: str, layer, buffers: dict) -> SiteHooks:
    """The `SiteHooks` of layer `layer` (traced int32) of attention kind `kind`; buffers: the captures of the
    layers run so far (read by the gates of scheduled edits)."""
    return SiteHooks(self.hooks, self.config, kind=kind, layer=layer, offset=self.offset, n_seq=self.n_seq,
                     readout=self.readout, earlier=lambda index: self._earlier(buffers, index), index=self.index,
                     kept=self.kept)

  def _layers(self, index: int, kind: str) -> list[int]:
    """The layers of attention kind `kind` that capture `index` reads, in its order."""
    layers = self.hooks.hooks.resolved_layers(self.config, self.hooks.hooks.captures[index])
    return [l for l in layers if l is not None and sites.layer_kind(self.config, l) == kind]

  def buffers(self, x: jax.Array) -> dict[str, Any]:
    """Zero buffers ``[L_k, ...]`` per (per-layer capture, attention kind): the capture's value at each of its
    layers of that kind (shapes from the reduction's abstract evaluation on the site's ``[B, T, *F]``); x: the
    embeddings [B, T, D] (B, T and dtype)."""
    out = {}
    for index, capture in enumerate(self.hooks.hooks.captures):
      for kind in ("s", "g"):
        layers = [] if capture.site in sites.MODEL_SITES else self._layers(index, kind)
        if not layers:
          continue
        shape = jax.eval_shape(lambda x, index=index, layer=layers[0]: self._zero_value(index, layer, x), x)
        out[_key(index, kind)] = jax.tree.map(lambda s, n=len(layers): jnp.zeros((n, *s.shape), s.dtype), shape)
    return out

  def _zero_value(self, index: int, layer: int, x: jax.Array):
    """For shapes only: capture `index` of zero site values at `layer` (x [B, T, D] gives B, T and dtype)."""
    c = self.config
    capture = self.hooks.hooks.captures[index]
    b, t = x.shape[:2]
    if capture.site == "attn.hook_pattern":
      return jnp.zeros((b, len(capture.positions), c.n_heads, self.n_seq), jnp.float32)
    dtype = jnp.float32 if capture.site == "mlp.hook_router_logits" else x.dtype
    value = jnp.zeros((b, t, *sites.feature_shape(c, capture.site, layer)), dtype)
    return reduce_capture(capture, self.hooks.values.captures[index], value, jnp.ones((b, t), bool), 0, self.n_seq,
                          self.readout)

  def write(self, kind: str, layer, buffers: dict, captured: dict) -> dict:
    """The buffers with this layer's captured values ({capture index: value}) written at the layer's slot
    (unchanged at a layer the capture does not read)."""
    out = dict(buffers)
    for index, value in captured.items():
      key = _key(index, kind)
      slot = jnp.asarray(slot_table(self.config, tuple(self._layers(index, kind))))[layer]
      at_slot = jnp.maximum(slot, 0)

      def write(buffer, new, slot=slot, at_slot=at_slot):
        old = jax.lax.dynamic_index_in_dim(buffer, at_slot, 0, keepdims=False)
        return jax.lax.dynamic_update_index_in_dim(buffer, jnp.where(slot >= 0, new.astype(buffer.dtype), old),
                                                   at_slot, 0)

      out[key] = jax.tree.map(write, buffers[key], value)
    return out

  def _earlier(self, buffers: dict, index: int):
    """Capture `index` (of one layer) as written so far in this forward: its value at that layer."""
    (layer,) = self.hooks.hooks.resolved_layers(self.config, self.hooks.hooks.captures[index])
    kind = sites.layer_kind(self.config, layer)
    slot = self._layers(index, kind).index(layer)
    return jax.tree.map(lambda a: a[slot], buffers[_key(index, kind)])

  def named(self, buffers: dict, model_captured: dict) -> dict[str, Any]:
    """{captured array name: value} from the per-layer buffers and the model-level captures."""
    out = {}
    for index, capture in enumerate(self.hooks.hooks.captures):
      if capture.site in sites.MODEL_SITES:
        out[capture.names((None,))[0]] = model_captured[index]
        continue
      layers = self.hooks.hooks.resolved_layers(self.config, capture)
      for layer, name in zip(layers, capture.names(layers)):
        kind = sites.layer_kind(self.config, layer)
        slot = self._layers(index, kind).index(layer)
        out[name] = jax.tree.map(lambda a, slot=slot: a[slot], buffers[_key(index, kind)])
    return out
