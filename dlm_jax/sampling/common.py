"""Pieces shared by the samplers: statistics plans, the biased model call, per-row top-k, filters.

Statistics. A sampler run has up to three consumers of attention statistics: the user's static
`StatsSpec`, the intervention's `required_stats(config)` (with its own `query_weights` when it asks for
query groups), and the per-step top-k sinks. `StatsPlan` computes their union in one forward pass
(incoming attention per head if anyone needs heads, the union of the requested layers, the query-group
blocks of every consumer side by side) and derives each consumer's view from it: layers are selected,
query groups are sliced or summed (the three sampler groups partition the queries, so their sum is the
all-queries map) and heads are averaged, as `dlm_jax.model.forward` would have returned them.

Query groups (when the user's spec has query_groups=3), built from the canvas of that step:
  0 masked:   query positions holding the mask token;
  1 unmasked: generation-region positions no longer holding the mask token;
  2 prompt:   prompt positions (pads included) not holding the mask token.

CFG. With classifier-free guidance the conditional and unconditional canvases run as one 2B batch (one
model evaluation: `nfe` counts forward calls). Statistics, top sinks and the intervention's `update`
see the conditional half only; the intervention's bias is applied to both halves.
"""

from __future__ import annotations

import collections
import dataclasses

import jax
import jax.numpy as jnp

from dlm_jax.config import ModelConfig
from dlm_jax.interventions import AttentionBias, CallContext, Intervention
from dlm_jax.model import forward, forward_cached
from dlm_jax.stats import NO_STATS, ForwardOutput, StatsSpec

TRACE_COUNTS: collections.Counter[str] = collections.Counter()
"""How many times each sampler's program was traced (incremented at trace time); tests check retracing."""

QUERY_GROUP_NAMES = ("masked", "unmasked", "prompt")


def _union_layers(specs: list[StatsSpec]) -> tuple[int, ...] | None:
  if any(s.layers is None for s in specs):
    return None
  return tuple(sorted(set().union(*(s.layers for s in specs))))


@dataclasses.dataclass(frozen=True)
class StatsPlan:
  """Static plan of the statistics one model call computes and who reads which part.

  Attributes:
    user: the caller's spec (query_groups 0 or 3).
    intervention: the intervention's `required_stats` (its query groups, if any, come from its
      `query_weights(state, context)`).
    sink_top_k: k of the per-step top-k sinks (0 = off).

  Query groups of the forward pass are laid out in blocks: "sampler" (the 3 groups of the module
  docstring, when the user asks for them), "all" (one all-ones group, when someone needs the sum over all
  queries and no sampler block gives it) and "intervention" (the intervention's groups). Without any
  grouped consumer the forward runs ungrouped.
  """

  user: StatsSpec = NO_STATS
  intervention: StatsSpec = NO_STATS
  sink_top_k: int = 0

  def __post_init__(self):
    if self.user.query_groups not in (0, len(QUERY_GROUP_NAMES)):
      raise ValueError(f"Samplers support StatsSpec.query_groups 0 or {len(QUERY_GROUP_NAMES)} "
                       f"({', '.join(QUERY_GROUP_NAMES)}), got {self.user.query_groups}.")
    if self.sink_top_k < 0:
      raise ValueError(f"sink_top_k must be >= 0, got {self.sink_top_k}.")

  @property
  def sinks_spec(self) -> StatsSpec:
    """Incoming attention the top-k sinks are taken from: the user's layers and head choice, all queries."""
    if not self.sink_top_k:
      return NO_STATS
    if self.user.incoming_attention:
      return StatsSpec(incoming_attention=True, per_head=self.user.per_head, layers=self.user.layers)
    return StatsSpec(incoming_attention=True, per_head=True)

  @property
  def group_blocks(self) -> tuple[tuple[str, int], ...]:
    """((name, size), ...) of the forward's query-group blocks; () = ungrouped."""
    consumers = [s for s in (self.user, self.intervention, self.sinks_spec) if s.incoming_attention]
    blocks = []
    if self.user.incoming_attention and self.user.query_groups:
      blocks.append(("sampler", len(QUERY_GROUP_NAMES)))
    if self.intervention.incoming_attention and self.intervention.query_groups:
      blocks.append(("intervention", self.intervention.query_groups))
    if blocks and not blocks[0][0] == "sampler" and any(not s.query_groups for s in consumers):
      blocks.insert(0, ("all", 1))
    return tuple(blocks)

  def _block(self, name: str) -> slice:
    start = 0
    for block, size in self.group_blocks:
      if block == name:
        return slice(start, start + size)
      start += size
    raise KeyError(name)

  @property
  def forward_spec(self) -> StatsSpec:
    """The one spec the forward pass is run with."""
    incoming = [s for s in (self.user, self.intervention, self.sinks_spec) if s.incoming_attention]
    values = [s for s in (self.user, self.intervention) if s.value_norms]
    if not incoming and not values:
      return NO_STATS
    return StatsSpec(
        incoming_attention=bool(incoming),
        per_head=any(s.per_head for s in incoming) if incoming else True,
        layers=_union_layers(incoming + values),
        query_groups=sum(size for _, size in self.group_blocks),
        value_norms=bool(values))

  def query_weights(self, sampler_weights, intervention_weights) -> jax.Array | None:
    """[B, Q, T] weights of the forward's groups, from zero-argument callables giving each block's."""
    parts = []
    for name, _ in self.group_blocks:
      if name == "sampler":
        parts.append(sampler_weights())
      elif name == "intervention":
        weights = intervention_weights()
        if weights is None:
          raise ValueError("The intervention's required_stats has query groups but its query_weights "
                           "returned None.")
        parts.append(weights.astype(jnp.float32))
      else:
        like = sampler_weights()
        parts.append(jnp.ones((like.shape[0], 1, like.shape[2]), jnp.float32))
    return jnp.concatenate(parts, axis=1) if parts else None

  def derive(self, output: ForwardOutput, target: StatsSpec, role: str = "user") -> ForwardOutput:
    """The `ForwardOutput` a forward run with `target` would have returned (same logits).

    role: "user" or "intervention": whose query groups a grouped target reads.
    """
    source = self.forward_spec
    incoming, values = None, None

    def select_layers(x):
      if target.layers == source.layers:
        return x
      index = target.layers if source.layers is None else tuple(source.layers.index(l) for l in target.layers)
      return x[jnp.asarray(index)]

    if target.incoming_attention:
      incoming = select_layers(output.incoming_attention)
      if source.query_groups:
        if target.query_groups:
          incoming = incoming[:, :, self._block("sampler" if role == "user" else "intervention")]
        elif self.group_blocks[0][0] == "sampler":
          incoming = jnp.sum(incoming[:, :, self._block("sampler")], axis=2)
        else:
          incoming = incoming[:, :, self._block("all").start]
      if source.per_head and not target.per_head:
        incoming = jnp.mean(incoming, axis=-2)
    if target.value_norms:
      values = select_layers(output.value_norms)
    return ForwardOutput(logits=output.logits, incoming_attention=incoming, value_norms=values)

  def user_stats(self, output: ForwardOutput) -> dict[str, jax.Array] | None:
    """The user's statistics of one call: {"incoming_attention": ..., "value_norms": ...} or None."""
    if not self.user.enabled:
      return None
    derived = self.derive(output, self.user)
    stats = {}
    if self.user.incoming_attention:
      stats["incoming_attention"] = derived.incoming_attention
    if self.user.value_norms:
      stats["value_norms"] = derived.value_norms
    return stats

  def intervention_output(self, output: ForwardOutput) -> ForwardOutput:
    return self.derive(output, self.intervention, role="intervention")

  def top_sinks(self, output: ForwardOutput, valid_keys: jax.Array) -> jax.Array | None:
    """Indices of the k keys with the most incoming attention: [L', B, N, k] (or [L', B, k]) int32.

    valid_keys: [B, S] bool; invalid keys (padding, unwritten cache slots) are never chosen.
    Ties: the lower position first.
    """
    if not self.sink_top_k:
      return None
    incoming = self.derive(output, self.sinks_spec).incoming_attention  # [L', B, (N,) S]
    valid = valid_keys[None, :, None, :] if incoming.ndim == 4 else valid_keys[None]
    scores = jnp.where(valid, incoming, -jnp.inf)
    k = min(self.sink_top_k, incoming.shape[-1])
    return jax.lax.top_k(scores, k)[1].astype(jnp.int32)


def make_plan(config: ModelConfig, stats_spec: StatsSpec, intervention: Intervention, sink_top_k: int) -> StatsPlan:
  """Validates the specs against `config` and returns the static plan."""
  plan = StatsPlan(user=stats_spec, intervention=intervention.required_stats(config), sink_top_k=sink_top_k)
  plan.forward_spec.check_layers(config.n_layers)
  return plan


def query_group_weights(tokens: jax.Array, mask_id: int, gen_start: int, query_offset=0) -> jax.Array:
  """[B, 3, T] float32 0/1 weights of the masked / unmasked-generated / prompt query groups.

  tokens: [B, T] the call's tokens, whose sequence positions are query_offset + 0..T-1."""
  masked = tokens == mask_id
  generated = (query_offset + jnp.arange(tokens.shape[1]))[None, :] >= gen_start
  groups = [masked, generated & ~masked, ~generated & ~masked]
  return jnp.stack(groups, axis=1).astype(jnp.float32)


def _concat_halves(a: jax.Array | None, b: jax.Array | None, batch: int, shared_ndim: int,
                   fill=0.0) -> jax.Array | None:
  """Stacks the biases of the conditional and unconditional halves along the batch axis.

  A None half gets `fill`; shared biases have `shared_ndim` dims (batch axis 0), per-layer ones one more
  (batch axis 1)."""
  if a is None and b is None:
    return None
  like = a if a is not None else b
  a = jnp.full((1,) * like.ndim, fill, like.dtype) if a is None else a
  b = jnp.full((1,) * like.ndim, fill, like.dtype) if b is None else b
  ndim = max(a.ndim, b.ndim)
  a = a.reshape((1,) * (ndim - a.ndim) + a.shape)
  b = b.reshape((1,) * (ndim - b.ndim) + b.shape)
  axis = 0 if ndim == shared_ndim else 1
  shape = list(jnp.broadcast_shapes(a.shape, b.shape))
  shape[axis] = batch
  return jnp.concatenate([jnp.broadcast_to(a, shape), jnp.broadcast_to(b, shape)], axis=axis)


def _double_bias(cond: AttentionBias, uncond: AttentionBias, batch: int) -> AttentionBias:
  """One AttentionBias for the 2B batch [conditional; unconditional]."""
  return AttentionBias(pairwise=_concat_halves(cond.pairwise, uncond.pairwise, batch, 4),
                       keys=_concat_halves(cond.keys, uncond.keys, batch, 3),
                       zero_values=_concat_halves(cond.zero_values, uncond.zero_values, batch, 2, fill=False))


def split_batch(tree, batch: int, half: int):
  """Keeps rows [half·batch, (half+1)·batch) of the batch axis of [L', 2B, ...] statistics."""
  return jax.tree.map(lambda x: x[:, half * batch:(half + 1) * batch], tree)


@dataclasses.dataclass(frozen=True)
class ModelCaller:
  """One model evaluation of a sampler step: bias = padding policy + intervention, stats per `plan`.

  Attributes:
    config: model config.
    plan: statistics plan.
    intervention: the attention-bias intervention (static).
    mask_id: mask token id (for the query groups; None for autoregressive models).
    gen_start: first generated position (for the query groups).
    logits_window: (start, stop) output positions whose logits are computed, or "last" (the last one).
    attention_impl, query_chunk: passed to `forward`.
  """

  config: ModelConfig
  plan: StatsPlan
  intervention: Intervention
  mask_id: int | None
  gen_start: int
  logits_window: tuple[int, int] | str | None
  attention_impl: str = "chunked"
  query_chunk: int = 128

  def __call__(self, params, tokens, step, istate, *, positions=None, base_bias=AttentionBias(),
               uncond_tokens=None, uncond_base_bias=None, valid_keys=None, cache=None, cache_offset=0,
               canvas=None, logits_offset=0):
    """Runs the model on tokens [B, T] (and the unconditional canvas [B, T] as a 2B batch when given).

    logits_offset: a traced shift of `logits_window` (see `dlm_jax.model.forward`).

    With `cache` (a `KVCache`), the call is `forward_cached` at `cache_offset`, the keys are the S cache
    positions and `canvas` [B, S] is the whole sequence the intervention sees (`CallContext.tokens`).
    Returns (logits [B, W, V] float32, uncond_logits [B, W, V] or None, user stats or None, top sinks or
    None, updated intervention state, updated cache or None).
    """
    batch, length = tokens.shape
    if cache is None:
      context = CallContext(step=jnp.asarray(step, jnp.int32), tokens=tokens)
    else:
      context = CallContext(step=jnp.asarray(step, jnp.int32), tokens=canvas, query_offset=cache_offset,
                            query_length=length)
    intervention_bias = self.intervention.bias(istate, context)
    bias = base_bias + intervention_bias
    spec = self.plan.forward_spec
    mask_id = -1 if self.mask_id is None else self.mask_id
    weights = None
    if spec.query_groups:
      weights = self.plan.query_weights(
          lambda: query_group_weights(tokens, mask_id, self.gen_start, cache_offset),
          lambda: self.intervention.query_weights(istate, context))
    model_tokens = tokens
    if uncond_tokens is not None:
      uncond_bias = (AttentionBias() if uncond_base_bias is None else uncond_base_bias) + intervention_bias
      bias = _double_bias(bias, uncond_bias, batch)
      model_tokens = jnp.concatenate([tokens, uncond_tokens], axis=0)
      if positions is not None:
        positions = jnp.concatenate([positions, positions], axis=0)
      if weights is not None:
        weights = jnp.concatenate([weights, weights], axis=0)
    window = (length - 1, length) if self.logits_window == "last" else self.logits_window
    kwargs = dict(config=self.config, positions=positions, query_weights=weights, stats_spec=spec,
                  logits_window=window, logits_offset=logits_offset, attention_impl=self.attention_impl,
                  query_chunk=self.query_chunk, **bias.forward_kwargs())
    if cache is None:
      output = forward(params, model_tokens, **kwargs)
    else:
      output, cache = forward_cached(params, model_tokens, cache, cache_offset, **kwargs)
    logits, uncond_logits = output.logits[:batch], None
    if uncond_tokens is not None:
      uncond_logits = output.logits[batch:]
      output = ForwardOutput(logits=logits, incoming_attention=split_batch(output.incoming_attention, batch, 0),
                             value_norms=split_batch(output.value_norms, batch, 0))
    istate = self.intervention.update(istate, self.plan.intervention_output(output), context)
    if valid_keys is None:
      valid_keys = jnp.ones((batch, length if cache is None else cache.keys.shape[2]), bool)
    sinks = self.plan.top_sinks(output, valid_keys)
    return logits, uncond_logits, self.plan.user_stats(output), sinks, istate, cache


def select_top_k(confidence: jax.Array, k: jax.Array) -> jax.Array:
  """Per-row top-k positions as a bool mask: confidence [B, W], k [B] or scalar int -> [B, W] bool.

  Ties are broken towards the lower index (a stable descending sort), which is what `torch.topk`
  returns for the distinct values met in practice; -inf entries are chosen only when k exceeds the
  number of finite ones.
  """
  order = jnp.argsort(-confidence, axis=-1, stable=True)
  k = jnp.broadcast_to(jnp.asarray(k, jnp.int32).reshape(-1, 1), (confidence.shape[0], 1))
  chosen_sorted = jnp.arange(confidence.shape[-1])[None, :] < k
  rows = jnp.arange(confidence.shape[0])[:, None]
  return jnp.zeros(confidence.shape, bool).at[rows, order].set(chosen_sorted)


def filter_top_p(logits: jax.Array, top_p: float) -> jax.Array:
  """Dream's `top_p_logits`: drop tokens once the cumulative probability (descending) exceeds top_p,
  keeping the first token that crosses it; dropped logits become finfo(float32).min. [..., V] -> same."""
  order = jnp.argsort(-logits, axis=-1, stable=True)
  sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
  cumulative = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
  remove_sorted = cumulative > top_p
  remove_sorted = jnp.concatenate([jnp.zeros_like(remove_sorted[..., :1]), remove_sorted[..., :-1]], axis=-1)
  remove = jnp.take_along_axis(remove_sorted, jnp.argsort(order, axis=-1), axis=-1)
  return jnp.where(remove, jnp.finfo(logits.dtype).min, logits)


def filter_top_k(logits: jax.Array, top_k: int) -> jax.Array:
  """Dream's `top_k_logits`: logits below the k-th largest become finfo(float32).min. [..., V] -> same."""
  k = min(top_k, logits.shape[-1])
  kth = jax.lax.top_k(logits, k)[0][..., -1:]
  return jnp.where(logits < kth, jnp.finfo(logits.dtype).min, logits)


def update_decode_step(decode_step: jax.Array, before: jax.Array, after: jax.Array, mask_id: int,
                       step: jax.Array) -> jax.Array:
  """decode_step [B, G]: set to `step` where a generated position stops holding the mask token, back to
  -1 where it holds the mask token again. before/after: [B, G] generated tokens around the step."""
  unmasked_now = (before == mask_id) & (after != mask_id)
  decode_step = jnp.where(unmasked_now, step, decode_step)
  return jnp.where(after == mask_id, -1, decode_step).astype(jnp.int32)


def stack_steps(per_step: list) -> object:
  """Stacks a Python list of per-step pytrees along a new leading axis (for the Python-loop path)."""
  if not per_step or per_step[0] is None:
    return None
  return jax.tree.map(lambda *xs: jnp.stack(xs), *per_step)
