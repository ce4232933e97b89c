"""LLaDA `generate` and MMaDA text generation as one compiled program (`reference/models.md` §2.8, §4.5–4.6).

The canvas is [B, Lp + G]: the (left-padded) prompt, then G mask tokens. The G positions are split into
G / block_length blocks decoded left to right, each in steps / num_blocks steps. One `lax.scan` runs over
all steps; step i works on block i // steps_per_block and, at the first step of a block, computes that
block's per-row transfer schedule from the masks the block holds then. Each step:

  1. logits of the current block only (CFG: conditional and unconditional canvases as one 2B batch,
     logits = un + (cfg_scale + 1)·(cond − un); the unconditional canvas has every position that was not a
     mask at the start, pads included, replaced by the mask token). The official code computes logits
     everywhere, but only the current block can transfer: later positions get confidence −inf and earlier
     blocks hold no mask (each block's schedule transfers exactly the masks it held), so the tokens are
     the same. When the prompt itself holds mask tokens the logits of the whole canvas are computed;
  2. `logits_eos_inf`: the EOS logit becomes −inf;
  3. x0 = argmax(logits) at temperature 0, else a Gumbel-max sample (see `gumbel_argmax`);
  4. `confidence_eos_eot_inf`, as the official code behaves (it aliases tensors): at temperature 0 the EOS
     and EoT logits used for the confidence are −inf (x0 was already chosen, so x0 may still be EOS, with
     confidence 0); at temperature > 0 only EoT's is;
  5. confidence: p(x0) under softmax(logits) (`low_confidence`) or U(0, 1) (`random`); −inf after the
     current block and at positions not holding the mask token;
  6. per row j, the schedule[j, s] most confident positions (ties: lower index first) take x0.

Precision. LLaDA's confidence softmax runs in the model dtype (the dtype of the parameters; our logits
are float32 and are cast to it); MMaDA's in float64, which JAX provides only with `jax_enable_x64` — without
it the MMaDA confidence is float32. The official Gumbel noise is float64: argmax(exp(l) / (−log u)^T), which
equals argmax(l − T·log(−log u)) = argmax(l + T·g) with g standard Gumbel. We evaluate that log form:
in float64 (u uniform in float64) when x64 is enabled, otherwise in float32 — the argmax is the same
except that float32 u bounds the Gumbel tail at ≈ 16.6 instead of ≈ 36.7 and float64 exp(l) would
overflow only for logits above 709 (never met).

Padding policies (a left-padded batch, `prompt_mask` 1 = real token):
  * "visible": the original HF LLaDA (Feb 2025): pads are ordinary tokens, no mask at all;
  * "key":     the Oct-2025 HF update: pad keys are removed from every query's view;
  * "outer":   MMaDA's callers: a boolean outer product mask(i) ∧ mask(j) over prompt + generation, so pad
               queries see nothing (finite, uniform rows) and real queries never see pads. MMaDA's CFG
               branch calls the model with no mask at all (`cfg_padding=False`). (MMaDA's own code builds
               the outer product from the prompt-length mask only, which does not fit the longer canvas
               when a batch is padded; we extend the mask with ones over the generation, the evident intent.)
Positions are never shifted for left padding (all versions).

Masks inside the prompt (infilling) are filled as in the official code: when the prompt holds the mask
token, logits are computed over the whole canvas (a host-side check selects that compiled variant).
Random draws (Gumbel noise at temperature > 0, random remasking) are drawn for the logits' window, so a
given key gives other samples than it would over the whole canvas.
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
from dlm_jax.sampling.common import (TRACE_COUNTS, ModelCaller, make_plan, select_top_k, stack_steps,
                                     update_decode_step)
from dlm_jax.sampling.schedules import llada_transfer_counts
from dlm_jax.sampling.trace import Trace
from dlm_jax.stats import NO_STATS, StatsSpec

Padding = Literal["visible", "key", "outer"]


@dataclasses.dataclass(frozen=True)
class LLaDAOptions:
  """Static knobs of LLaDA's `generate` (defaults as in the official signature) and its MMaDA variants.

  Attributes:
    gen_length: G, number of generated positions.
    steps: total denoising steps; a multiple of the number of blocks.
    block_length: positions per block (None = gen_length, pure diffusion); must divide gen_length.
    temperature: 0 for argmax, > 0 for Gumbel-max sampling at that temperature.
    cfg_scale: classifier-free guidance weight w (> 0 enables it): logits = un + (w + 1)·(cond − un).
    remasking: "low_confidence" or "random".
    logits_eos_inf: EOS can never be sampled.
    confidence_eos_eot_inf: the official (temperature-dependent) EOS/EoT confidence quirk; module docstring.
    padding: "visible", "key" or "outer" (module docstring); only used when a prompt mask is given.
    cfg_padding: apply the padding policy to the CFG calls as well (MMaDA: False, no mask under CFG).
    confidence_dtype: None (the model dtype, LLaDA), "float32" or "float64" (MMaDA; float32 without x64).
    stop_token_id: MMaDA `mmu_generate_fast`: after a block, stop when every row's last position of that
      block holds this id (later blocks stay masks, their steps are skipped). None = never stop.
    mask_token_id, eos_token_id, eot_token_id: overrides of the config's ids (None = config).
  """

  gen_length: int = 128
  steps: int = 128
  block_length: int | None = None
  temperature: float = 0.0
  cfg_scale: float = 0.0
  remasking: Literal["low_confidence", "random"] = "low_confidence"
  logits_eos_inf: bool = False
  confidence_eos_eot_inf: bool = False
  padding: Padding = "visible"
  cfg_padding: bool = True
  confidence_dtype: Literal["float32", "float64"] | None = None
  stop_token_id: int | None = None
  mask_token_id: int | None = None
  eos_token_id: int | None = None
  eot_token_id: int | None = None

  def __post_init__(self):
    if not isinstance(self.gen_length, int) or self.gen_length <= 0:
      raise ValueError(f"gen_length must be a positive integer, got {self.gen_length!r}.")
    if self.block_length is not None and (not isinstance(self.block_length, int) or self.block_length <= 0):
      raise ValueError(f"block_length must be a positive integer or None, got {self.block_length!r}.")
    if self.gen_length % self.block: 
      raise ValueError(f"gen_length ({self.gen_length}) must be a multiple of block_length ({self.block}); "
                       "change one of them.")
    if not isinstance(self.steps, int) or self.steps <= 0 or self.steps % self.num_blocks:
      raise ValueError(f"steps ({self.steps}) must be a positive multiple of the number of blocks "
                       f"gen_length / block_length = {self.num_blocks}.")
    if self.temperature < 0 or self.cfg_scale < 0:
      raise ValueError(f"temperature and cfg_scale must be >= 0, got {self.temperature}, {self.cfg_scale}.")
    if self.remasking not in ("low_confidence", "random"):
      raise ValueError(f"remasking must be 'low_confidence' or 'random', got {self.remasking!r}.")
    if self.padding not in ("visible", "key", "outer"):
      raise ValueError(f"padding must be 'visible', 'key' or 'outer', got {self.padding!r}.")
    if self.confidence_dtype not in (None, "float32", "float64"):
      raise ValueError(f"confidence_dtype must be None, 'float32' or 'float64', got {self.confidence_dtype!r}.")

  @property
  def block(self) -> int:
    return self.gen_length if self.block_length is None else self.block_length

  @property
  def num_blocks(self) -> int:
    return self.gen_length // self.block

  @property
  def steps_per_block(self) -> int:
    return self.steps // self.num_blocks


def mmada_options(**overrides: Any) -> LLaDAOptions:
  """MMaDA's `generate` / `mmu_generate` (models.md §4.6): float64 confidence, the bool outer-product
  padding mask (none under CFG), no EOS knobs. For `mmu_generate_fast` pass stop_token_id=<eot id>."""
  values = dict(padding="outer", cfg_padding=False, confidence_dtype="float64")
  values.update(overrides)
  return LLaDAOptions(**values)


def gumbel_argmax(logits: jax.Array, temperature: float, key: jax.Array) -> jax.Array:
  """argmax over the last axis of l − T·log(−log u), u ~ U(0, 1): an exact sample of softmax(l / T).

  Float64 when `jax_enable_x64` is on (as the official code), float32 otherwise. [..., V] -> [...] int32.
  """
  dtype = jnp.float64 if jax.config.jax_enable_x64 else jnp.float32
  u = jax.random.uniform(key, logits.shape, dtype, minval=jnp.finfo(dtype).tiny, maxval=1.0)
  scores = logits.astype(dtype) - jnp.asarray(temperature, dtype) * jnp.log(-jnp.log(u))
  return jnp.argmax(scores, axis=-1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class _Static:
  config: ModelConfig
  options: LLaDAOptions
  caller: ModelCaller
  prompt_length: int
  block_window: bool
  mask_id: int
  eos_id: int | None
  eot_id: int | None
  confidence_dtype: str


def _special_ids(config: ModelConfig, options: LLaDAOptions) -> tuple[int, int | None, int | None]:
  mask_id = config.mask_token_id if options.mask_token_id is None else options.mask_token_id
  eos_id = config.eos_token_id if options.eos_token_id is None else options.eos_token_id
  eot_id = config.eot_token_id if options.eot_token_id is None else options.eot_token_id
  if mask_id is None:
    raise ValueError("LLaDA sampling needs a mask token id: set ModelConfig.mask_token_id or options.mask_token_id.")
  if (options.logits_eos_inf or options.confidence_eos_eot_inf) and eos_id is None:
    raise ValueError("logits_eos_inf / confidence_eos_eot_inf need an EOS id (config or options.eos_token_id).")
  if options.confidence_eos_eot_inf and eot_id is None:
    raise ValueError("confidence_eos_eot_inf needs an EoT id (config.eot_token_id or options.eot_token_id).")
  return mask_id, eos_id, eot_id


def _padding_biases(static: _Static, mask: jax.Array | None) -> tuple[AttentionBias, AttentionBias]:
  """(conditional, unconditional) padding biases from the extended mask [B, S] (True = real token)."""
  policy = static.options.padding
  if mask is None or policy == "visible":
    return AttentionBias(), AttentionBias()
  if policy == "key":
    bias = AttentionBias(keys=jnp.where(mask, 0.0, MASK_VALUE)[:, None, :])
  else:
    pair = mask[:, :, None] & mask[:, None, :]
    bias = AttentionBias(pairwise=jnp.where(pair, 0.0, MASK_VALUE)[:, None])
  return bias, (bias if static.options.cfg_padding else AttentionBias())


def _confidence_dtype(static: _Static, params) -> Any:
  if static.confidence_dtype == "model":
    return params["embed"]["embedding"].dtype
  if static.confidence_dtype == "float64" and jax.config.jax_enable_x64:
    return jnp.float64
  return jnp.float32


def _denoise(static: _Static, params, logits, uncond_logits, x_win, window_start, schedule_now, block_end, key):
  """One step's sampling and transfer on the window [window_start, window_start + W): logits [B, W, V],
  x_win [B, W] -> new x_win."""
  o = static.options
  if o.cfg_scale > 0:
    logits = uncond_logits + (o.cfg_scale + 1.0) * (logits - uncond_logits)
  if o.logits_eos_inf:
    logits = logits.at[..., static.eos_id].set(-jnp.inf)
  noise_key, random_key = jax.random.split(key)
  if o.temperature == 0:
    x0 = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  else:
    x0 = gumbel_argmax(logits, o.temperature, noise_key)
  confidence_logits = logits
  if o.confidence_eos_eot_inf:
    if o.temperature == 0:
      confidence_logits = confidence_logits.at[..., static.eos_id].set(-jnp.inf)
    confidence_logits = confidence_logits.at[..., static.eot_id].set(-jnp.inf)
  if o.remasking == "low_confidence":
    probs = jax.nn.softmax(confidence_logits.astype(_confidence_dtype(static, params)), axis=-1)
    x0_p = jnp.take_along_axis(probs, x0[..., None], axis=-1)[..., 0]
  else:
    x0_p = jax.random.uniform(random_key, x0.shape, jnp.float32)
  position = window_start + jnp.arange(x_win.shape[1])
  x0_p = jnp.where(position[None, :] >= block_end, -jnp.inf, x0_p)
  masked = x_win == static.mask_id
  x0 = jnp.where(masked, x0, x_win)
  confidence = jnp.where(masked, x0_p, -jnp.inf)
  transfer = select_top_k(confidence, schedule_now)
  return jnp.where(transfer, x0, x_win)


def _constants(static: _Static, canvas, prompt_mask):
  """Loop invariants: the CFG prompt index, padding biases and the keys valid for the top sinks."""
  mask = None
  if prompt_mask is not None:
    gen = jnp.ones((canvas.shape[0], static.options.gen_length), bool)
    mask = jnp.concatenate([prompt_mask.astype(bool), gen], axis=1)
  cond_bias, uncond_bias = _padding_biases(static, mask)
  return dict(prompt_index=canvas != static.mask_id, cond_bias=cond_bias, uncond_bias=uncond_bias,
              valid_keys=jnp.ones(canvas.shape, bool) if mask is None else mask)


def _init_carry(static: _Static, canvas, key, istate):
  b = canvas.shape[0]
  o = static.options
  return dict(x=canvas, key=key, schedule=jnp.zeros((b, o.steps_per_block), jnp.int32),
              decode_step=jnp.full((b, o.gen_length), -1, jnp.int32), nfe=jnp.zeros((), jnp.int32),
              done=jnp.zeros((), bool), istate=istate)


def _step(static: _Static, params, consts, carry, i):
  """One denoising step: carry -> (carry, (stats, top_sinks))."""
  o = static.options
  lp, mask_id = static.prompt_length, static.mask_id
  block, s = i // o.steps_per_block, i % o.steps_per_block
  block_start = lp + block * o.block
  x = carry["x"]
  block_tokens = jax.lax.dynamic_slice_in_dim(x, block_start, o.block, axis=1)
  new_schedule = llada_transfer_counts(jnp.sum(block_tokens == mask_id, axis=1), o.steps_per_block)
  schedule = jnp.where(s == 0, new_schedule, carry["schedule"])
  done = carry["done"]
  if o.stop_token_id is not None:
    last = jax.lax.dynamic_index_in_dim(x, jnp.maximum(block_start - 1, 0), axis=1, keepdims=False)
    done = done | ((s == 0) & (block > 0) & jnp.all(last == o.stop_token_id))
  key, step_key = jax.random.split(carry["key"])

  def compute(_):
    uncond = None
    if o.cfg_scale > 0:
      uncond = jnp.where(consts["prompt_index"], mask_id, x)
    logits, uncond_logits, stats, sinks, istate, _ = static.caller(
        params, x, i, carry["istate"], base_bias=consts["cond_bias"], uncond_tokens=uncond,
        uncond_base_bias=consts["uncond_bias"], valid_keys=consts["valid_keys"],
        logits_offset=block * o.block if static.block_window else 0)
    window_start = block_start if static.block_window else 0
    x_win = jax.lax.dynamic_slice_in_dim(x, window_start, logits.shape[1], axis=1)
    x_win = _denoise(static, params, logits, uncond_logits, x_win, window_start, schedule[:, s],
                     block_start + o.block, step_key)
    return jax.lax.dynamic_update_slice_in_dim(x, x_win, window_start, axis=1), istate, stats, sinks

  if o.stop_token_id is None:
    new_x, istate, stats, sinks = compute(None)
  else:
    shapes = jax.eval_shape(compute, None)
    skip = lambda _: (x, carry["istate"], *jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes[2:]))
    new_x, istate, stats, sinks = jax.lax.cond(done, skip, compute, None)
  decode_step = update_decode_step(carry["decode_step"], x[:, lp:], new_x[:, lp:], mask_id, i)
  nfe = carry["nfe"] + jnp.where(done, 0, 1).astype(jnp.int32)
  carry = dict(x=new_x, key=key, schedule=schedule, decode_step=decode_step, nfe=nfe, done=done, istate=istate)
  return carry, (stats, sinks)


def _finish(static: _Static, carry, ys) -> Trace:
  stats, sinks = ys
  return Trace(tokens=carry["x"], decode_step=carry["decode_step"], nfe=carry["nfe"], stats=stats,
               top_sinks=sinks, prompt_length=static.prompt_length)


@functools.partial(jax.jit, static_argnames=("static",), donate_argnames=("canvas",))
def _run(params, canvas, prompt_mask, key, istate, static: _Static) -> Trace:
  TRACE_COUNTS["llada"] += 1
  consts = _constants(static, canvas, prompt_mask)
  carry = _init_carry(static, canvas, key, istate)
  step = functools.partial(_step, static, params, consts)
  carry, ys = jax.lax.scan(step, carry, jnp.arange(static.options.steps, dtype=jnp.int32))
  return _finish(static, carry, ys)


def _run_python_loop(params, canvas, prompt_mask, key, istate, static: _Static) -> Trace:
  """The same step function driven by a Python loop (one jitted call per step); for tests."""
  consts = _constants(static, canvas, prompt_mask)
  carry = _init_carry(static, canvas, key, istate)
  step = jax.jit(functools.partial(_step, static), donate_argnums=())
  per_step = []
  for i in range(static.options.steps):
    carry, ys = step(params, consts, carry, jnp.int32(i))
    per_step.append(ys)
  stats = stack_steps([y[0] for y in per_step])
  sinks = stack_steps([y[1] for y in per_step])
  return _finish(static, carry, (stats, sinks))


def generate(
    params: dict,
    prompt: jax.Array | np.ndarray,
    *,
    config: ModelConfig,
    options: LLaDAOptions = LLaDAOptions(),
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
  """LLaDA / MMaDA masked-diffusion generation (module docstring), one compiled program per shape.

  Args:
    params: model parameters.
    prompt: [B, Lp] int token ids, left-padded for batches.
    config: model config (static).
    options: `LLaDAOptions` (static; `mmada_options(...)` for MMaDA).
    key: PRNG key (temperature > 0, random remasking); default key(0).
    prompt_mask: [B, Lp] 1 = real token, 0 = pad; None = no padding.
    stats_spec: per-step attention statistics to return (static).
    intervention: attention-bias intervention applied at every step (static).
    intervention_state: its initial state; default `intervention.init_state(config, B, Lp + G)`.
    sink_top_k: also return the per-step top-k sinks (0 = off).
    attention_impl, query_chunk: attention path (static).
    loop: "scan" (the compiled program) or "python" (same step function, Python loop; for tests).

  Returns:
    `Trace` with tokens [B, Lp + G], decode_step [B, G], nfe, stats [steps, ...], top_sinks.
  """
  prompt = jnp.asarray(prompt, jnp.int32)
  if prompt.ndim != 2:
    raise ValueError(f"prompt must be [B, Lp] token ids, got shape {prompt.shape}.")
  if prompt_mask is not None:
    prompt_mask = jnp.asarray(prompt_mask).astype(bool)
    if prompt_mask.shape != prompt.shape:
      raise ValueError(f"prompt_mask must have the prompt's shape {prompt.shape}, got {prompt_mask.shape}.")
  mask_id, eos_id, eot_id = _special_ids(config, options)
  b, lp = prompt.shape
  total = lp + options.gen_length
  block_window = not bool(np.any(np.asarray(prompt) == mask_id))
  plan = make_plan(config, stats_spec, intervention, sink_top_k)
  caller = ModelCaller(config=config, plan=plan, intervention=intervention, mask_id=mask_id, gen_start=lp,
                       logits_window=(lp, lp + options.block) if block_window else (0, total),
                       attention_impl=attention_impl, query_chunk=query_chunk)
  static = _Static(config=config, options=options, caller=caller, prompt_length=lp, block_window=block_window,
                   mask_id=mask_id, eos_id=eos_id, eot_id=eot_id,
                   confidence_dtype=options.confidence_dtype or "model")
  canvas = jnp.concatenate([prompt, jnp.full((b, options.gen_length), mask_id, jnp.int32)], axis=1)
  key = jax.random.key(0) if key is None else key
  if intervention_state is None:
    intervention_state = intervention.init_state(config, b, total)
  runner = _run if loop == "scan" else _run_python_loop
  return runner(params, canvas, prompt_mask, key, intervention_state, static=static)
