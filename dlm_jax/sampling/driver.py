"""The one sampler loop: every decoding family runs through `run_family` here.

The driver owns everything that is not a family's own: `run_family` validates the prompt and its mask,
builds the canvas (prompt, then G filler tokens), the padding layout (`dlm_jax.sampling.padding`), the
statistics plan (`dlm_jax.stats.StatsPlan`) and the model caller (`model_call.ModelCaller`), initialises
the intervention, runs the loop — one compiled program (`lax.scan` over the steps, donated canvas), or the
same step function driven by a Python loop for tests — and builds the `Trace`, squeezing statistics to
the users' shapes at this one edge.

A decoding family is a small frozen `Family` subclass (its static options and constants, its carry — a
`flax.struct` dataclass — and its step function) and its public function made by `public_sampler`; see
BUILD.md, "The sampler driver and adding a decoding family".
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable
from typing import Any, ClassVar, Literal

import jax
import jax.numpy as jnp
import numpy as np

from dlm_jax.config import ModelConfig
from dlm_jax.interventions import NO_INTERVENTION, Intervention
from dlm_jax.sampling import keys, padding
from dlm_jax.sampling.model_call import ModelCaller, StepOutput
from dlm_jax.sampling.trace import Trace
from dlm_jax.stats import NO_STATS, StatsSpec, make_plan

TRACE_COUNTS: collections.Counter[str] = collections.Counter()
"""How many times each family's program was traced (incremented at trace time); tests check retracing."""

Loop = Literal["scan", "python"]


@dataclasses.dataclass(frozen=True)
class Family:
  """What a decoding family supplies (subclass it as a frozen dataclass; instances are static).

  Fields: options, the family's frozen options (with a `gen_length`, and a `steps` unless `n_steps` is
  overridden); subclasses add their resolved ids.

  Class attributes:
    name: key of `TRACE_COUNTS`.
    min_prompt_length: shortest prompt accepted.
    has_prefill: step 0 is `prefill` (traced apart: its shapes differ, e.g. a KV-cache prefill), steps
      1..n−1 are `step`; otherwise every step is `step`.
    padding_attention, shift_positions: the padding policy (`dlm_jax.sampling.padding`).

  Methods (`run` is the static `Run`; carries are `flax.struct` dataclasses):
    gen_length, n_steps, fill_id (the generation's initial token), query_mask_id (for the sampler's query
      groups): static facts.
    check(config): raises ValueError when the family cannot run this model.
    constants(run, canvas, layout) -> loop invariants (a pytree), from the canvas and `PaddingLayout`.
    init_carry(run, params, canvas, key, consts) -> the initial carry.
    step(run, params, consts, carry, istate, i) -> (carry, istate, StepOutput): step i (traced int32).
    prefill(run, params, consts, carry, istate) -> (carry, istate, StepOutput), when has_prefill.
    outcome(run, carry) -> (tokens [B, S], decode_step [B, G], nfe): what the `Trace` reports.
  """

  options: Any

  name: ClassVar[str] = "family"
  min_prompt_length: ClassVar[int] = 0
  has_prefill: ClassVar[bool] = False
  padding_attention: ClassVar[padding.PaddingAttention] = "key"
  shift_positions: ClassVar[bool] = False

  @property
  def gen_length(self) -> int:
    return self.options.gen_length

  @property
  def n_steps(self) -> int:
    return self.options.steps

  @property
  def fill_id(self) -> int:
    raise NotImplementedError

  @property
  def query_mask_id(self) -> int | None:
    return None

  def check(self, config: ModelConfig) -> None:
    del config

  def constants(self, run: Run, canvas: jax.Array, layout: padding.PaddingLayout) -> Any:
    del run, canvas
    return layout

  def init_carry(self, run: Run, params, canvas: jax.Array, key: jax.Array, consts: Any) -> Any:
    raise NotImplementedError

  def step(self, run: Run, params, consts: Any, carry: Any, istate: Any, i: jax.Array):
    raise NotImplementedError

  def prefill(self, run: Run, params, consts: Any, carry: Any, istate: Any):
    raise NotImplementedError

  def outcome(self, run: Run, carry: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
    raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class MaskedDiffusionFamily(Family):
  """A family whose generation starts as mask tokens (LLaDA/MMaDA, Dream): mask_id fills the canvas and
  defines the masked query group; its carry has `tokens`, `decode_step` and `nfe` fields."""

  mask_id: int

  @property
  def fill_id(self) -> int:
    return self.mask_id

  @property
  def query_mask_id(self) -> int:
    return self.mask_id

  def outcome(self, run: Run, carry: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
    return carry.tokens, carry.decode_step, carry.nfe


@dataclasses.dataclass(frozen=True)
class Run:
  """Static facts of one sampler run, handed to every family method.

  family: the decoding family; config: the model config; caller: the model call (it holds the
  statistics plan and the intervention); prompt_length: Lp; total_length: S = Lp + G; row_keys: the run's
  key is [B] keys, one per row (`dlm_jax.sampling.keys`).
  """

  family: Family
  config: ModelConfig
  caller: ModelCaller
  prompt_length: int
  total_length: int
  row_keys: bool = False


def _stack(outputs: list[StepOutput]) -> StepOutput:
  return jax.tree.map(lambda *xs: jnp.stack(xs), *outputs)


def _prepend(first: StepOutput | None, rest: StepOutput | None) -> StepOutput:
  if first is None:
    return rest
  if rest is None:
    return jax.tree.map(lambda a: a[None], first)
  return jax.tree.map(lambda a, b: jnp.concatenate([a[None], b], axis=0), first, rest)


def _start(run: Run, params, canvas, prompt_mask, key):
  layout = padding.layout(prompt_mask, run.total_length, run.family.padding_attention,
                          run.family.shift_positions, canvas.shape[0])
  consts = run.family.constants(run, canvas, layout)
  return consts, run.family.init_carry(run, params, canvas, key, consts)


def _trace(run: Run, carry, outputs: StepOutput | None) -> Trace:
  """The users' `Trace`: statistics squeezed to their shapes (the one place that does it)."""
  tokens, decode_step, nfe = run.family.outcome(run, carry)
  plan = run.caller.plan
  outputs = StepOutput() if outputs is None else outputs
  return Trace(tokens=tokens, decode_step=decode_step, nfe=nfe, stats=plan.squeeze_user(outputs.stats),
               top_sinks=plan.squeeze_sinks(outputs.top_sinks), intervention_record=outputs.record,
               prompt_length=run.prompt_length)


@functools.partial(jax.jit, static_argnames=("run",), donate_argnames=("canvas",))
def _compiled(params, canvas, prompt_mask, key, istate, run: Run) -> Trace:
  TRACE_COUNTS[run.family.name] += 1
  family = run.family
  consts, carry = _start(run, params, canvas, prompt_mask, key)
  first = None
  if family.has_prefill:
    carry, istate, first = family.prefill(run, params, consts, carry, istate)

  def body(state, i):
    carry, istate = state
    carry, istate, outputs = family.step(run, params, consts, carry, istate, i)
    return (carry, istate), outputs

  rest = None
  start = int(family.has_prefill)
  if family.n_steps > start:
    (carry, istate), rest = jax.lax.scan(body, (carry, istate), jnp.arange(start, family.n_steps, dtype=jnp.int32))
  return _trace(run, carry, _prepend(first, rest))


def _python_loop(params, canvas, prompt_mask, key, istate, run: Run) -> Trace:
  """The same family functions driven by a Python loop (one jitted call per step); for tests."""
  family = run.family
  consts, carry = jax.jit(functools.partial(_start, run))(params, canvas, prompt_mask, key)
  outputs = []
  if family.has_prefill:
    carry, istate, first = jax.jit(functools.partial(family.prefill, run))(params, consts, carry, istate)
    outputs.append(first)
  step = jax.jit(functools.partial(family.step, run))
  for i in range(int(family.has_prefill), family.n_steps):
    carry, istate, out = step(params, consts, carry, istate, jnp.int32(i))
    outputs.append(out)
  return _trace(run, carry, _stack(outputs) if outputs else None)


def run_family(
    family: Family,
    params: dict,
    prompt: jax.Array | np.ndarray,
    *,
    config: ModelConfig,
    key: jax.Array | None = None,
    prompt_mask: jax.Array | np.ndarray | None = None,
    stats_spec: StatsSpec = NO_STATS,
    intervention: Intervention = NO_INTERVENTION,
    intervention_state: Any = None,
    sink_top_k: int = 0,
    attention_impl: str = "chunked",
    query_chunk: int = 128,
    loop: Loop = "scan",
    record_intervention: bool = False,
) -> Trace:
  """Runs `family` on a [B, Lp] prompt and returns the `Trace` (see the family's public wrapper).

  Args:
    family: the decoding family with its options (static).
    params: model parameters.
    prompt: [B, Lp] int token ids, left-padded for batches.
    config: model config (static).
    key: PRNG key (default key(0)), or [B] keys, one per row: row b's draws then depend only on its key
      (`dlm_jax.sampling.keys`).
    prompt_mask: [B, Lp] 1 = real token, 0 = pad; None = no padding.
    stats_spec: per-step attention statistics to return (static).
    intervention: attention-bias intervention applied at every step (static).
    intervention_state: its initial state; default `intervention.init_state(config, B, Lp + G)`.
    sink_top_k: also return the per-step top-k sinks (0 = off).
    attention_impl, query_chunk: attention path (static).
    loop: "scan" (the compiled program) or "python" (same step function, Python loop; for tests).
    record_intervention: stack the intervention's per-step record into `Trace.intervention_record`.
  """
  prompt = jnp.asarray(prompt)
  if prompt.ndim != 2 or not jnp.issubdtype(prompt.dtype, jnp.integer):
    raise ValueError(f"prompt must be [B, Lp] integer token ids, got shape {prompt.shape} of {prompt.dtype}.")
  if prompt.shape[1] < family.min_prompt_length:
    raise ValueError(f"{family.name} sampling needs a prompt of at least {family.min_prompt_length} token(s), "
                     f"got shape {prompt.shape}.")
  prompt = prompt.astype(jnp.int32)
  if prompt_mask is not None:
    prompt_mask = jnp.asarray(prompt_mask).astype(bool)
    if prompt_mask.shape != prompt.shape:
      raise ValueError(f"prompt_mask must have the prompt's shape {prompt.shape}, got {prompt_mask.shape}.")
  if loop not in ("scan", "python"):
    raise ValueError(f"loop must be 'scan' or 'python', got {loop!r}.")
  family.check(config)
  b, lp = prompt.shape
  total = lp + family.gen_length
  plan = make_plan(config, stats_spec, intervention, sink_top_k, padded=prompt_mask is not None)
  caller = ModelCaller(config=config, plan=plan,
                       intervention=intervention, mask_id=family.query_mask_id, gen_start=lp,
                       attention_impl=attention_impl, query_chunk=query_chunk,
                       record_intervention=record_intervention)
  key, row_keys = keys.as_run_key(key, b)
  run = Run(family=family, config=config, caller=caller, prompt_length=lp, total_length=total, row_keys=row_keys)
  canvas = jnp.concatenate([prompt, jnp.full((b, family.gen_length), family.fill_id, jnp.int32)], axis=1)
  if intervention_state is None:
    intervention_state = intervention.init_state(config, b, total)
  runner = _compiled if loop == "scan" else _python_loop
  return runner(params, canvas, prompt_mask, key, intervention_state, run=run)


def public_sampler(build_family: Callable[[ModelConfig, Any, Any], Family], default_options: Any, doc: str):
  """A family's public `generate`-style function (one signature for every family; `doc` is its docstring).

  build_family(config, options, prompt) -> Family resolves the family's ids (raising ValueError with a
  clear message when they are missing). The function's keyword arguments after `options` are those of
  `run_family`.
  """

  def sample(params: dict, prompt: jax.Array | np.ndarray, *, config: ModelConfig, options: Any = default_options,
             key: jax.Array | None = None, prompt_mask: jax.Array | np.ndarray | None = None,
             stats_spec: StatsSpec = NO_STATS, intervention: Intervention = NO_INTERVENTION,
             intervention_state: Any = None, sink_top_k: int = 0, attention_impl: str = "chunked",
             query_chunk: int = 128, loop: Loop = "scan", record_intervention: bool = False) -> Trace:
    return run_family(build_family(config, options, prompt), params, prompt, config=config, key=key,
               prompt_mask=prompt_mask, stats_spec=stats_spec, intervention=intervention,
               intervention_state=intervention_state, sink_top_k=sink_top_k, attention_impl=attention_impl,
               query_chunk=query_chunk, loop=loop, record_intervention=record_intervention)

  sample.__doc__ = doc
  sample.__module__ = build_family.__module__
  return sample
