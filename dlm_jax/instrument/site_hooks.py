"""Hooks at work inside one forward call: edits applied and captures reduced at the named sites.

The Transformer builds a `SiteHooks` for its model-level sites and one per layer inside its layer scan
(`dlm_jax.model.transformer`); the modules call it at each site (`at(hooks, kind, x)`), which returns the
(edited) value and records the captures. Captures are placed in sequence coordinates: the call's T queries
sit at sequence positions offset..offset+T−1 of S (a KV-cache call's offset; 0 otherwise), or at the
positions `index` [B, T] (a compute policy's subset call, `dlm_jax.instrument.query_rows`), and the other
positions hold zeros. Shapes as in `dlm_jax.instrument.hook_call`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dlm_jax.config import ModelConfig
from dlm_jax.instrument import sae_hooks, sites
from dlm_jax.instrument.hook_call import VALID, CaptureValues, EditValues, HookCall, class_mask
from dlm_jax.instrument.hook_spec import Capture, Edit
from dlm_jax.instrument.query_rows import QueryRows
from dlm_jax.instrument.step_schedule import gate_reading, scheduled_add


@struct.dataclass
class TopK:
  """The k largest values over the feature axis and their indices: [..., k] float32 and int32."""

  values: jax.Array
  indices: jax.Array


@struct.dataclass
class LensReadout:
  """The logit lens at one site: probability [B, S] and rank [B, S] int32 (0 = the most probable token) of
  the target token, and the k most probable tokens [B, S, k] int32 with their probabilities [B, S, k]."""

  probability: jax.Array
  rank: jax.Array
  top_tokens: jax.Array
  top_probabilities: jax.Array


def _rows(offset) -> QueryRows:
  """The call's `QueryRows` from an offset (scalar, the queries contiguous from it) or a `QueryRows`."""
  return offset if isinstance(offset, QueryRows) else QueryRows(offset=offset)


def _expand(mask: jax.Array, ndim: int) -> jax.Array:
  """mask [B, T(, N)] with trailing unit axes up to rank ndim."""
  return mask.reshape(mask.shape + (1,) * (ndim - mask.ndim))


def _lens(x: jax.Array, targets: jax.Array, k: int, readout: Callable[[jax.Array], jax.Array]) -> LensReadout:
  """x [B, T, D] residual values, targets [B, T] -> `LensReadout` over the T positions."""
  logits = readout(x)
  log_probs = jax.nn.log_softmax(logits, axis=-1)
  target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)
  rank = jnp.sum(logits > target_logit, axis=-1, dtype=jnp.int32)
  top_log_probs, top_tokens = jax.lax.top_k(log_probs, k)
  return LensReadout(probability=jnp.exp(jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]),
                     rank=rank, top_tokens=top_tokens.astype(jnp.int32), top_probabilities=jnp.exp(top_log_probs))


def reduce_capture(capture: Capture, values: CaptureValues, x: jax.Array, selected: jax.Array, offset, n_seq: int,
                   readout: Callable[[jax.Array], jax.Array] | None):
  """One capture of site values x [B, T, F...] of the queries `selected` [B, T] (its position class): an
  array or `TopK` / `LensReadout`, in sequence coordinates [B, S | P, ...] (or [B, F...] for "mean"); offset:
  the first query's sequence position, or the call's `QueryRows`.
  readout(h, normalized=...) -> logits: the final norm (skipped at ln_final.hook_normalized) and LM head."""
  if capture.reduce == "mean":
    weights = _expand(selected.astype(jnp.float32), x.ndim)
    total = jnp.sum(x.astype(jnp.float32) * weights, axis=1)
    return total / jnp.maximum(jnp.sum(weights, axis=1), 1.0)
  if capture.reduce == "none":
    y = x
  elif capture.reduce == "norm":
    y = jnp.linalg.norm(x.astype(jnp.float32), axis=-1)
  elif capture.reduce == "topk":
    top, index = jax.lax.top_k(x.astype(jnp.float32), capture.k)
    y = TopK(values=top, indices=index.astype(jnp.int32))
  elif capture.reduce == "project":
    y = jnp.einsum("...f,rf->...r", x.astype(jnp.float32), values.directions.astype(jnp.float32))
  elif capture.reduce == "sae":
    y = sae_hooks.features(values.sae, x)
    if capture.k:
      top, index = jax.lax.top_k(y, capture.k)
      y = TopK(values=top, indices=index.astype(jnp.int32))
  else:
    targets = _rows(offset).take(values.targets, x.shape[1])
    normalized = capture.site == "ln_final.hook_normalized"  # the final norm is applied already
    y = _lens(x, targets, capture.k, lambda h: readout(h, normalized=normalized))
  y = jax.tree.map(lambda a: _rows(offset).place(jnp.where(_expand(selected, a.ndim), a, jnp.zeros((), a.dtype)),
                                                  n_seq), y)
  if isinstance(capture.positions, tuple):
    index = np.asarray(capture.positions)
    if index.max() >= n_seq:
      raise ValueError(f"Capture of {capture.site} asks for sequence position {int(index.max())}, but the call "
                       f"has {n_seq} positions.")
    y = jax.tree.map(lambda a: a[:, index], y)
  return y


def apply_edit(edit: Edit, values: EditValues, x: jax.Array, slot, step, flags: jax.Array, offset,
               gate: jax.Array | None = None) -> jax.Array:
  """Site values x [B, T, F...] with `edit` applied where its values allow it: at layer slot `slot` (its index
  in the edit's layers, −1 when the layer is not one of them), step `step`, queries of flags [B, T] at offset
  (the first query's sequence position, or the call's `QueryRows`); gate: the [B, T] reading of a scheduled
  edit's gate (`dlm_jax.instrument.step_schedule`)."""
  t = x.shape[1]
  rows = _rows(offset)
  slot = jnp.asarray(slot, jnp.int32)
  layer_on = jnp.take(values.layers, jnp.maximum(slot, 0), axis=1) & (slot >= 0)
  row = layer_on & (values.window[:, 0] <= step) & (step < values.window[:, 1])
  source = None
  if values.values is not None:
    at_step = values.value_steps == step
    row = row & jnp.any(at_step)
    per_step = jnp.take(values.values, jnp.argmax(at_step), axis=0)
    source = rows.take(jnp.take(per_step, jnp.maximum(slot, 0), axis=0), t)
  elif values.vector is not None:
    source = values.vector[:, None]
  where = row[:, None] & class_mask(edit.positions, flags) & rows.take(values.positions, t)
  if values.heads is not None:
    where = where[:, :, None] & values.heads[:, None, :]
  where = _expand(where, x.ndim)
  if edit.schedule is not None:
    return scheduled_add(values, values.schedule, x, where, step, gate)
  coefficient = None if values.coefficient is None else _expand(values.coefficient, x.ndim)
  if edit.op == "zero":
    new = jnp.zeros((), x.dtype)
  elif edit.op == "mean":
    weights = jnp.broadcast_to(where, x.shape).astype(jnp.float32)
    new = jnp.sum(x.astype(jnp.float32) * weights, axis=1, keepdims=True) / jnp.maximum(
        jnp.sum(weights, axis=1, keepdims=True), 1.0)
  elif edit.op == "replace":
    new = source
  elif edit.op == "add":
    new = x + coefficient * source
  elif edit.op in sae_hooks.SAE_OPS:  # an encode and a decode: only where some row is edited at this layer and step
    new = jax.lax.cond(jnp.any(where), lambda: sae_hooks.edited(
        edit.op, values.sae, x, values.feature_mask, values.feature_value, values.feature_add).astype(x.dtype),
                       lambda: x)
  else:
    new = coefficient * x
  return jnp.where(where, jnp.asarray(new).astype(x.dtype), x)


def slot_table(config: ModelConfig, layers: tuple[int | None, ...], kind: str | None = None) -> np.ndarray:
  """[L] int32: each layer's index among `layers` (only those of attention kind `kind` when given), −1 for
  a layer not among them."""
  table = np.full((config.n_layers,), -1, np.int32)
  kept = [l for l in layers if l is not None and (kind is None or sites.layer_kind(config, l) == kind)]
  table[kept] = np.arange(len(kept), dtype=np.int32)
  return table


GATED_REDUCTIONS = ("lens", "topk", "project", "sae")


def _gated(capture: Capture) -> bool:
  return capture.reduce in GATED_REDUCTIONS or capture.site == "attn.hook_pattern"


class SiteHooks:
  """The hooks of one forward call at one layer (`layer` traced int32) of attention kind `kind`, or at the
  model-level sites (layer None).

  offset: sequence position of the call's first query; index: [B, T] int32 the queries' sequence positions
  instead (a subset call: padded with S; `call.flags` are then [B, S] over the sequence), or None; kept: [B, T]
  bool, the queries whose captures are kept (the others capture zeros; edits act on every query), or None
  (all); n_seq: S; readout(h, normalized): final norm (unless
  `normalized`) + LM head, [B, T, D] -> float32 logits [B, T, V] (the "lens" reduction); earlier(index) ->
  capture `index`'s value at its (single) layer in this forward, already computed (the gates of scheduled
  edits; None at the model level). After the sites ran, `captured` maps each capture index acting here to its
  reduced value.

  The costly captures (`GATED`: the lens, top-k, projections, attention rows) are computed under a
  `lax.cond` only at their own layers and kept steps (`HookCall.keep`); elsewhere they are zeros, which
  nothing keeps. The cheap ones are computed at every layer of their kind and kept only at theirs.
  """

  def __init__(self, call: HookCall, config: ModelConfig, *, kind: str | None, layer, offset, n_seq: int,
               readout: Callable[[jax.Array], jax.Array] | None, earlier: Callable[[int], object] | None = None,
               index: jax.Array | None = None, kept: jax.Array | None = None):
    self.call, self.config, self.kind, self.layer = call, config, kind, layer
    self.offset, self.n_seq, self.readout, self.earlier = offset, n_seq, readout, earlier
    self.rows = QueryRows(offset=offset, index=index)
    self.kept = kept
    hooks = call.hooks
    self.captures = [i for i, c in enumerate(hooks.captures) if self._acts(c)]
    self.edits = [i for i, e in enumerate(hooks.edits) if self._acts(e)]
    self.kinds = frozenset(hooks.captures[i].site for i in self.captures) | frozenset(
        hooks.edits[i].site for i in self.edits)
    self.captured: dict[int, object] = {}

  def _acts(self, item: Capture | Edit) -> bool:
    """The item names a site here: a model-level site at the model level, else a layer of this kind."""
    if self.kind is None:
      return item.site in sites.MODEL_SITES
    if item.site in sites.MODEL_SITES:
      return False
    layers = self.call.hooks.resolved_layers(self.config, item)
    return any(sites.layer_kind(self.config, l) == self.kind for l in layers)

  def wants(self, site: str) -> bool:
    return site in self.kinds

  def _slot(self, item: Edit) -> jax.Array | int:
    if self.kind is None:
      return 0
    table = slot_table(self.config, self.call.hooks.resolved_layers(self.config, item))
    return jnp.asarray(table)[self.layer]

  def _wanted(self, index: int) -> jax.Array | None:
    """Scalar bool: capture `index` is kept at this layer and this call's step (None: at every one)."""
    wanted = None
    if self.kind is not None:
      wanted = self._slot(self.call.hooks.captures[index]) >= 0
    if self.call.keep is not None:
      wanted = self.call.keep[index] if wanted is None else wanted & self.call.keep[index]
    return wanted

  def _capture(self, index: int, reduce: Callable[[], object]) -> None:
    """Records capture `index` = reduce(), behind a `lax.cond` on `_wanted` for a costly one."""
    wanted = self._wanted(index) if _gated(self.call.hooks.captures[index]) else None
    if wanted is None:
      self.captured[index] = reduce()
      return
    shapes = jax.eval_shape(reduce)
    zeros = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)  # noqa: E731
    self.captured[index] = jax.lax.cond(wanted, reduce, zeros)

  def _gate(self, edit: Edit, t: int, rows: QueryRows) -> jax.Array | None:
    """[B, T] the gate reading of a scheduled, gated edit at the call's queries (None for other edits)."""
    if edit.schedule is None or edit.schedule.gate is None:
      return None
    index = self.call.hooks.capture_names(self.config)[edit.schedule.gate.capture]
    return gate_reading(self.earlier(index), self.call.hooks.captures[index].reduce, rows, t)

  def flags(self, t: int, start=0) -> jax.Array:
    """[B, T] class bits of the queries start..start+T−1 of the call (all VALID without flags; none at a subset
    call's padded entries)."""
    flags = self.call.flags
    if self.rows.index is not None:
      rows = self.rows.shifted(start, t)
      real = rows.index < self.n_seq
      return jnp.where(real, VALID if flags is None else rows.take(flags, t), 0).astype(jnp.int32)
    if flags is None:
      return None
    return jax.lax.dynamic_slice_in_dim(flags, jnp.asarray(start, jnp.int32), t, axis=1)

  def __call__(self, site: str, x: jax.Array, start=0) -> jax.Array:
    """x [B, T, F...] at `site` -> x with the edits applied; captures recorded. start: index of x's first
    position among the call's queries (the logits window at ln_final)."""
    if site not in self.kinds:
      return x
    flags = self.flags(x.shape[1], start)
    if flags is None:
      flags = jnp.full(x.shape[:2], VALID, jnp.int32)
    rows = self.rows.shifted(start, x.shape[1])
    hooks = self.call.hooks
    for i in self.edits:
      if hooks.edits[i].site == site:
        x = apply_edit(hooks.edits[i], self.call.values.edits[i], x, self._slot(hooks.edits[i]), self.call.step,
                       flags, rows, self._gate(hooks.edits[i], x.shape[1], rows))
    for i in self.captures:
      capture = hooks.captures[i]
      if capture.site == site:
        selected = class_mask("all" if isinstance(capture.positions, tuple) else capture.positions, flags)
        if self.kept is not None:
          selected = selected & jax.lax.dynamic_slice_in_dim(self.kept, jnp.asarray(start, jnp.int32), x.shape[1],
                                                             axis=1)
        self._capture(i, lambda capture=capture, i=i, selected=selected: reduce_capture(
            capture, self.call.values.captures[i], x, selected, rows, self.n_seq, self.readout))
    return x

  def pattern(self, probabilities: Callable[[jax.Array], jax.Array], n_queries: int, batch: int) -> None:
    """Records the attn.hook_pattern captures: probabilities(weights [B, P, T]) -> [B, P, N, S] is the layer's
    attention with those query weights (one-hot rows: the P chosen queries' probabilities over the keys the
    call's queries read; a query this call did not compute gets a zero row)."""
    for i in self.captures:
      capture = self.call.hooks.captures[i]
      if capture.site == "attn.hook_pattern":
        query_index = self.rows.positions(n_queries)
        chosen = jnp.asarray(capture.positions, jnp.int32)
        weights = (query_index[:, None, :] == chosen[None, :, None]).astype(jnp.float32)
        weights = jnp.broadcast_to(weights, (batch, *weights.shape[1:]))
        if self.kept is not None:
          weights = weights * self.kept[:, None, :].astype(weights.dtype)
        self._capture(i, lambda weights=weights: probabilities(weights))


def at(hooks: SiteHooks | None, site: str, x: jax.Array) -> jax.Array:
  """x at `site`: through the hooks when there are any (edits applied, captures recorded), else unchanged."""
  return x if hooks is None else hooks(site, x)
