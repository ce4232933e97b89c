"""Autoregressive decoding with a KV cache for the baselines (LLaMA-3, Qwen2.5, SmolLM2), one program.

Step 0 is the prefill (the whole prompt, writing the cache at 0..Lp−1) and yields the first new token;
step i ≥ 1 feeds the token produced at step i − 1 at sequence position Lp + i − 1 (a `lax.scan`). Every
step is one model evaluation, so nfe = G and per-step statistics are over the S = Lp + G cache positions
(keys not yet written receive nothing: the causal mask hides them).

Left padding (`prompt_mask`): pad keys are removed (key bias) and positions are cumsum(mask) − 1 with pads
at 1, generated tokens continuing from the last real position, as Hugging Face `generate` does.
Sampling follows the Hugging Face warper order: temperature, top-k, top-p (filters of
`dlm_jax.sampling.common`), then a categorical draw; temperature 0 is argmax (first index on ties).
With `stop_at_eos`, a row that produced an EOS id keeps producing the pad id (shapes stay fixed).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from dlm_jax.attention import MASK_VALUE
from dlm_jax.config import ModelConfig
from dlm_jax.interventions import NO_INTERVENTION, AttentionBias, Intervention
from dlm_jax.model import KVCache
from dlm_jax.sampling.common import TRACE_COUNTS, ModelCaller, filter_top_k, filter_top_p, make_plan, stack_steps
from dlm_jax.sampling.trace import Trace
from dlm_jax.stats import NO_STATS, StatsSpec


@dataclasses.dataclass(frozen=True)
class AROptions:
  """Static knobs of autoregressive decoding.

  Attributes:
    gen_length: G, new tokens.
    temperature: 0 = greedy; > 0 samples.
    top_k, top_p: filters applied when sampling (None = off).
    stop_at_eos: after an EOS id, a row produces the pad id.
    eos_token_ids: ids that end a row (None = the config's eos and eot ids).
    pad_token_id: id produced after EOS (None = the config's pad, else its eos).
  """

  gen_length: int = 128
  temperature: float = 0.0
  top_k: int | None = None
  top_p: float | None = None
  stop_at_eos: bool = False
  eos_token_ids: tuple[int, ...] | None = None
  pad_token_id: int | None = None

  def __post_init__(self):
    if not isinstance(self.gen_length, int) or self.gen_length <= 0:
      raise ValueError(f"gen_length must be a positive integer, got {self.gen_length!r}.")
    if self.temperature < 0:
      raise ValueError(f"temperature must be >= 0, got {self.temperature}.")
    if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k <= 0):
      raise ValueError(f"top_k must be None or a positive integer, got {self.top_k!r}.")


@dataclasses.dataclass(frozen=True)
class _Static:
  config: ModelConfig
  options: AROptions
  caller: ModelCaller
  prompt_length: int
  eos_ids: tuple[int, ...]
  pad_id: int


def _next_token(options: AROptions, logits: jax.Array, key: jax.Array) -> jax.Array:
  """logits [B, V] float32 -> [B] int32."""
  if options.temperature == 0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits / options.temperature
  if options.top_k is not None:
    logits = filter_top_k(logits, options.top_k)
  if options.top_p is not None and options.top_p < 1:
    logits = filter_top_p(logits, options.top_p)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def _call(static: _Static, params, consts, canvas, cache, offset, length: int, istate, step):
  """Feeds canvas[:, offset:offset+length]; returns (last logits [B, V], cache, stats, sinks, istate)."""
  tokens = jax.lax.dynamic_slice_in_dim(canvas, offset, length, axis=1)
  positions = jax.lax.dynamic_slice_in_dim(consts["positions"], offset, length, axis=1)
  written = jnp.arange(canvas.shape[1])[None, :] < offset + length
  logits, _, stats, sinks, istate, cache = static.caller(
      params, tokens, step, istate, positions=positions, base_bias=consts["bias"],
      valid_keys=consts["valid_keys"] & written, cache=cache, cache_offset=offset, canvas=canvas)
  return logits[:, -1], cache, stats, sinks, istate


def _emit(static: _Static, canvas, finished, token, position):
  """Writes `token` [B] at `position`, respecting stop_at_eos; returns (canvas, finished)."""
  if static.options.stop_at_eos:
    token = jnp.where(finished, static.pad_id, token)
    finished = finished | jnp.isin(token, jnp.asarray(static.eos_ids))
  canvas = jax.lax.dynamic_update_slice_in_dim(canvas, token[:, None], position, axis=1)
  return canvas, finished


def _constants(static: _Static, canvas, prompt_mask):
  b, total = canvas.shape
  if prompt_mask is None:
    positions = jnp.broadcast_to(jnp.arange(total, dtype=jnp.int32), (b, total))
    return dict(positions=positions, bias=AttentionBias(), valid_keys=jnp.ones((b, total), bool))
  mask = jnp.concatenate([prompt_mask.astype(bool), jnp.ones((b, total - prompt_mask.shape[1]), bool)], axis=1)
  positions = jnp.where(mask, jnp.cumsum(mask.astype(jnp.int32), axis=1) - 1, 1)
  return dict(positions=positions, bias=AttentionBias(keys=jnp.where(mask, 0.0, MASK_VALUE)[:, None, :]),
              valid_keys=mask)


def _prefill(static: _Static, params, consts, canvas, key, istate):
  b, total = canvas.shape
  cache = KVCache.zeros(static.config, b, total, params["embed"]["embedding"].dtype)
  key, sample_key = jax.random.split(key)
  logits, cache, stats, sinks, istate = _call(static, params, consts, canvas, cache, 0, static.prompt_length,
                                              istate, 0)
  canvas, finished = _emit(static, canvas, jnp.zeros((b,), bool), _next_token(static.options, logits, sample_key),
                           static.prompt_length)
  return dict(x=canvas, cache=cache, key=key, finished=finished, istate=istate), (stats, sinks)


def _step(static: _Static, params, consts, carry, i):
  """Decoding step i >= 1: feeds the token at Lp + i − 1 and writes the one at Lp + i."""
  key, sample_key = jax.random.split(carry["key"])
  offset = static.prompt_length + i - 1
  logits, cache, stats, sinks, istate = _call(static, params, consts, carry["x"], carry["cache"], offset, 1,
                                              carry["istate"], i)
  canvas, finished = _emit(static, carry["x"], carry["finished"], _next_token(static.options, logits, sample_key),
                           offset + 1)
  return dict(x=canvas, cache=cache, key=key, finished=finished, istate=istate), (stats, sinks)


def _concat_steps(first, rest):
  if first is None:
    return None
  if rest is None:
    return jax.tree.map(lambda a: a[None], first)
  return jax.tree.map(lambda a, b: jnp.concatenate([a[None], b], axis=0), first, rest)


def _finish(static: _Static, carry, first, rest) -> Trace:
  b = carry["x"].shape[0]
  g = static.options.gen_length
  decode_step = jnp.broadcast_to(jnp.arange(g, dtype=jnp.int32), (b, g))
  return Trace(tokens=carry["x"], decode_step=decode_step, nfe=jnp.asarray(g, jnp.int32),
               stats=_concat_steps(first[0], rest[0]), top_sinks=_concat_steps(first[1], rest[1]),
               prompt_length=static.prompt_length)


@functools.partial(jax.jit, static_argnames=("static",), donate_argnames=("canvas",))
def _run(params, canvas, prompt_mask, key, istate, static: _Static) -> Trace:
  TRACE_COUNTS["ar"] += 1
  consts = _constants(static, canvas, prompt_mask)
  carry, first = _prefill(static, params, consts, canvas, key, istate)
  rest = (None, None)
  if static.options.gen_length > 1:
    carry, rest = jax.lax.scan(functools.partial(_step, static, params, consts), carry,
                               jnp.arange(1, static.options.gen_length, dtype=jnp.int32))
  return _finish(static, carry, first, rest)


def _run_python_loop(params, canvas, prompt_mask, key, istate, static: _Static) -> Trace:
  """The same prefill and step functions driven by a Python loop; for tests."""
  consts = _constants(static, canvas, prompt_mask)
  carry, first = jax.jit(functools.partial(_prefill, static))(params, consts, canvas, key, istate)
  step = jax.jit(functools.partial(_step, static))
  per_step = []
  for i in range(1, static.options.gen_length):
    carry, ys = step(params, consts, carry, jnp.int32(i))
    per_step.append(ys)
  rest = (stack_steps([y[0] for y in per_step]), stack_steps([y[1] for y in per_step]))
  return _finish(static, carry, first, rest)


def generate(
    params: dict,
    prompt: jax.Array | np.ndarray,
    *,
    config: ModelConfig,
    options: AROptions = AROptions(),
    key: jax.Array | None = None,
    prompt_mask: jax.Array | np.ndarray | None = None,
    stats_spec: StatsSpec = NO_STATS,
    intervention: Intervention = NO_INTERVENTION,
    intervention_state: Any = None,
    sink_top_k: int = 0,
    attention_impl: str = "chunked",
    query_chunk: int = 128,
    loop: Literal["scan", "python"] = "scan",
) -> Trace:
  """Greedy or sampled decoding of a causal model with a KV cache (module docstring).

  Args:
    params: model parameters of a causal config.
    prompt: [B, Lp] int token ids (Lp >= 1), left-padded for batches.
    config, options, key, prompt_mask, stats_spec, intervention, intervention_state, sink_top_k,
      attention_impl, query_chunk, loop: as in `dlm_jax.sampling.llada.generate`. Query groups (when asked)
      are masked (always empty), generated and prompt queries.

  Returns:
    `Trace` with tokens [B, Lp + G], decode_step[b, i] = i, nfe = G, stats over the S = Lp + G keys.
  """
  if not config.causal:
    raise ValueError(f"Autoregressive decoding needs a causal model; config {config.name!r} is bidirectional.")
  prompt = jnp.asarray(prompt, jnp.int32)
  if prompt.ndim != 2 or prompt.shape[1] < 1:
    raise ValueError(f"prompt must be [B, Lp] token ids with Lp >= 1, got shape {prompt.shape}.")
  if prompt_mask is not None:
    prompt_mask = jnp.asarray(prompt_mask).astype(bool)
    if prompt_mask.shape != prompt.shape:
      raise ValueError(f"prompt_mask must have the prompt's shape {prompt.shape}, got {prompt_mask.shape}.")
  eos_ids = options.eos_token_ids
  if eos_ids is None:
    eos_ids = tuple(i for i in (config.eos_token_id, config.eot_token_id) if i is not None)
  pad_id = options.pad_token_id
  if pad_id is None:
    pad_id = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id
  if options.stop_at_eos and (not eos_ids or pad_id is None):
    raise ValueError("stop_at_eos needs EOS and pad ids (config or AROptions.eos_token_ids / pad_token_id).")
  b, lp = prompt.shape
  total = lp + options.gen_length
  caller = ModelCaller(config=config, plan=make_plan(config, stats_spec, intervention, sink_top_k),
                       intervention=intervention, mask_id=None, gen_start=lp, logits_window="last",
                       attention_impl=attention_impl, query_chunk=query_chunk)
  static = _Static(config=config, options=options, caller=caller, prompt_length=lp, eos_ids=tuple(eos_ids),
                   pad_id=0 if pad_id is None else pad_id)
  filler = static.pad_id
  canvas = jnp.concatenate([prompt, jnp.full((b, options.gen_length), filler, jnp.int32)], axis=1)
  key = jax.random.key(0) if key is None else key
  if intervention_state is None:
    intervention_state = intervention.init_state(config, b, total)
  runner = _run if loop == "scan" else _run_python_loop
  return runner(params, canvas, prompt_mask, key, intervention_state, static=static)
