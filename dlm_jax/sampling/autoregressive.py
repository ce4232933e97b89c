"""Autoregressive decoding with a KV cache for the baselines (LLaMA-3, Qwen2.5, SmolLM2), one program.

Step 0 is the prefill (the whole prompt, writing the cache at 0..Lp−1) and yields the first new token;
step i ≥ 1 feeds the token produced at step i − 1 at sequence position Lp + i − 1 (a `lax.scan`). Every
step is one model evaluation, so nfe = G and per-step statistics are over the S = Lp + G cache positions
(keys not yet written receive nothing: the causal mask hides them).

Left padding (`prompt_mask`; `dlm_jax.sampling.padding`): pad keys are removed (key bias) and positions are
cumsum(mask) − 1 with pads at 1, generated tokens continuing from the last real position, as Hugging Face
`generate` does.
Sampling follows the Hugging Face warper order: temperature, top-k, top-p (filters of
`dlm_jax.sampling.selection`), then a categorical draw; temperature 0 is argmax (first index on ties).
With `stop_at_eos`, a row that produced an EOS id keeps producing the pad id (shapes stay fixed).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from dlm_jax.config import ModelConfig
from dlm_jax.instrument.interventions import Intervention
from dlm_jax.model import KVCache
from dlm_jax.sampling import driver, keys, padding
from dlm_jax.sampling.call_inputs import CacheCall, CallInputs, Readout
from dlm_jax.sampling.selection import filter_top_k, filter_top_p


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


def _next_token(options: AROptions, logits: jax.Array, key: jax.Array, per_row: bool) -> jax.Array:
  """logits [B, V] float32 -> [B] int32 (per_row: `key` is [B] keys)."""
  if options.temperature == 0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits / options.temperature
  if options.top_k is not None:
    logits = filter_top_k(logits, options.top_k)
  if options.top_p is not None and options.top_p < 1:
    logits = filter_top_p(logits, options.top_p)
  return keys.categorical(key, logits, per_row).astype(jnp.int32)


@struct.dataclass
class ARCarry:
  """tokens [B, S] (the prompt, then the tokens produced so far); cache: the `KVCache` of S positions;
  key; finished [B] bool (a row produced an EOS id; with stop_at_eos)."""

  tokens: jax.Array
  cache: KVCache
  key: jax.Array
  finished: jax.Array


@dataclasses.dataclass(frozen=True)
class ARFamily(driver.Family):
  """KV-cache decoding of a causal model (module docstring) with resolved EOS and pad ids."""

  eos_ids: tuple[int, ...]
  pad_id: int

  name = "ar"
  min_prompt_length = 1
  shift_positions = True

  def phases(self, run) -> tuple[driver.Phase, ...]:
    """The prompt's prefill (an opening: its shapes differ), then G − 1 one-token steps."""
    return (driver.Phase(steps=self.options.gen_length - 1, opening=True),)

  @property
  def fill_id(self) -> int:
    return self.pad_id

  def check(self, config: ModelConfig, intervention: Intervention) -> None:
    del intervention
    if not config.causal:
      raise ValueError(f"Autoregressive decoding needs a causal model; config {config.name!r} is bidirectional.")

  def init_carry(self, run, params, sequence, key, consts) -> ARCarry:
    b, total = sequence.shape
    cache = KVCache.zeros(run.config, b, total, params["embed"]["embedding"].dtype)
    return ARCarry(tokens=sequence, cache=cache, key=key, finished=jnp.zeros((b,), bool))

  def _feed(self, run, params, consts: padding.PaddingLayout, carry: ARCarry, istate, offset, length: int, step):
    """Feeds tokens[:, offset:offset+length] and writes the next token at offset + length."""
    key, sample_key = keys.split(carry.key, 2, run.row_keys)
    sequence = carry.tokens
    tokens = jax.lax.dynamic_slice_in_dim(sequence, offset, length, axis=1)
    positions = jax.lax.dynamic_slice_in_dim(consts.positions, offset, length, axis=1)
    written = jnp.arange(sequence.shape[1])[None, :] < offset + length
    query_valid = jax.lax.dynamic_slice_in_dim(consts.valid, offset, length, axis=1)
    result = run.caller(params, step, istate, CallInputs(tokens, positions, query_valid, consts.valid & written,
                                                         consts.bias),
                        Readout(window="last"), CacheCall(carry.cache, offset, sequence))
    token = _next_token(self.options, result.logits[:, -1], sample_key, run.row_keys)
    finished = carry.finished
    if self.options.stop_at_eos:
      token = jnp.where(finished, self.pad_id, token)
      finished = finished | jnp.isin(token, jnp.asarray(self.eos_ids))
    sequence = jax.lax.dynamic_update_slice_in_dim(sequence, token[:, None], offset + length, axis=1)
    carry = ARCarry(tokens=sequence, cache=result.cache, key=key, finished=finished)
    queries = jnp.stack([jnp.asarray(offset, jnp.int32), jnp.asarray(offset + length, jnp.int32)])
    return carry, result.state, result.outputs.replace(queries=queries)

  def open_phase(self, run, params, consts, carry, istate, i, phase):
    """Step 0: the whole prompt (cache positions 0..Lp−1) yields the first new token."""
    return self._feed(run, params, consts, carry, istate, 0, run.prompt_length, i)

  def step(self, run, params, consts, carry, istate, i, phase):
    """Step i >= 1: feeds the token at Lp + i − 1 and writes the one at Lp + i."""
    return self._feed(run, params, consts, carry, istate, run.prompt_length + i - 1, 1, i)

  def outcome(self, run, carry: ARCarry):
    b, g = carry.tokens.shape[0], self.options.gen_length
    return carry.tokens, jnp.broadcast_to(jnp.arange(g, dtype=jnp.int32), (b, g))


def _family(config: ModelConfig, options: AROptions, prompt) -> ARFamily:
  del prompt
  eos_ids = options.eos_token_ids
  if eos_ids is None:
    eos_ids = tuple(i for i in (config.eos_token_id, config.eot_token_id) if i is not None)
  pad_id = options.pad_token_id
  if pad_id is None:
    pad_id = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id
  if options.stop_at_eos and (not eos_ids or pad_id is None):
    raise ValueError("stop_at_eos needs EOS and pad ids (config or AROptions.eos_token_ids / pad_token_id).")
  return ARFamily(options=options, eos_ids=tuple(eos_ids), pad_id=0 if pad_id is None else pad_id)


generate = driver.public_sampler(_family, AROptions(), """Greedy or sampled decoding of a causal model with a
KV cache (module docstring).

Args:
  params: model parameters of a causal config.
  prompt: [B, Lp] int token ids (Lp >= 1), left-padded for batches.
  key: one key or [B] row keys (see `dlm_jax.sampling.driver.run_family`).
  config, options, prompt_mask, setup: see `driver.run_family` (`setup`: a `RunSetup`; old keywords such as
    stats_spec= are deprecated). Query groups (when asked) are masked (always empty), generated and prompt
    queries.

Returns:
  `Trace` with tokens [B, Lp + G], decode_step[b, i] = i, nfe = G, stats over the S = Lp + G keys.
""")
