"""The one sampler loop: every decoding family runs through `run_family` here.

The driver owns everything that is not a family's own: `run_family` validates the prompt and its mask,
builds the sequence (prompt, then G filler tokens), the padding layout (`dlm_jax.sampling.padding`), the
statistics plan (`dlm_jax.sampling.stats_plan.StatsPlan`) and the model caller (`model_call.ModelCaller`), initialises
the intervention, runs the loop — one compiled program (`lax.scan` over the steps, donated sequence), or the
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
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from dlm_jax.config import ModelConfig
from dlm_jax.core.old_keywords import fold_old_keywords
from dlm_jax.instrument import step_schedule
from dlm_jax.instrument.hook_spec import Hooks
from dlm_jax.instrument.interventions import Intervention
from dlm_jax.policy.base import ComputePolicy, PolicyError, RunLayout
from dlm_jax.sampling import capture_steps, keys, padding, replicated_rows, row_by_row
from dlm_jax.sampling.call_plan import CallPlan
from dlm_jax.sampling.model_call import ModelCaller, StepOutput
from dlm_jax.sampling.run_setup import DEFAULT_SETUP, SAMPLER_MOVES, RunSetup
from dlm_jax.sampling.trace import Trace
from dlm_jax.sampling.stats_plan import make_plan

TRACE_COUNTS: collections.Counter[str] = collections.Counter()
"""How many times each family's program was traced (incremented at trace time); tests check retracing."""


@dataclasses.dataclass(frozen=True)
class Phase:
  """A stretch of the loop with static shapes (e.g. one block of a KV-cache mode).

  arg: static value handed to the family's `open_phase` and `step` (e.g. the block index; None for
    families with one phase).
  steps: the most calls of `Family.step` the phase makes (a bound when the family finishes early).
  opening: the phase starts with one call of `Family.open_phase` (e.g. a KV-cache prefill or refresh,
    whose shapes differ from the steps'), counted as a step of its own.
  """

  arg: Any = None
  steps: int = 0
  opening: bool = False


@dataclasses.dataclass(frozen=True)
class Family:
  """What a decoding family supplies (subclass it as a frozen dataclass; instances are static).

  Fields: options, the family's frozen options (with a `gen_length`, and a `steps` unless `n_steps` or
  `phases` is overridden); subclasses add their resolved ids.

  Class attributes:
    name: key of `TRACE_COUNTS`.
    min_prompt_length: shortest prompt accepted.
    padding_attention, shift_positions: the padding policy (`dlm_jax.sampling.padding`).
    can_finish_early: `finished` may be true (the driver then guards every call with a `lax.cond`).
    runs_policies: a compute policy (`dlm_jax.policy`) can decide what the family's calls compute — every call
      reads the whole sequence with no KV cache of its own, or (block diffusion, `policy_cache` "block") the
      family's cached calls take the policy's key subsets; `check_policy` refuses what its options cannot run.

  Every call of `open_phase` or `step` is one model evaluation ("step"); the driver numbers the steps it
  runs 0, 1, … (the `i` handed to the family) and writes step i's `StepOutput` at index i of the
  `[max_steps, ...]` buffers of the `Trace`, `max_steps` being the sum of the phases' bounds. Steps that
  `finished` skips make no call, take no index and leave no output.

  Methods (`run` is the static `Run`; carries are `flax.struct` dataclasses):
    gen_length, n_steps, fill_id (the generation's initial token), query_mask_id (for the sampler's query
      groups): static facts.
    phases(run) -> the static `Phase`s, run in order (default: one phase of n_steps steps).
    check(config): raises ValueError when the family cannot run this model.
    constants(run, sequence, layout) -> loop invariants (a pytree), from the sequence and `PaddingLayout`.
    init_carry(run, params, sequence, key, consts) -> the initial carry.
    finished(run, consts, carry, i, phase) -> scalar bool: skip the next call of this phase (every row is
      done with it); only called when can_finish_early.
    open_phase(run, params, consts, carry, istate, i, phase) -> (carry, istate, StepOutput), for a phase
      with an opening.
    step(run, params, consts, carry, istate, i, phase) -> (carry, istate, StepOutput): step i (traced
      int32). A family whose rows can be idle in a batch (done with the phase while others are not) sets
      `StepOutput.active` [B] to the rows the step decoded for (default: all); the driver then keeps the
      intervention state of the rows that waited (`Intervention.keep_rows`), so a row's state does not
      depend on its batch. A call that decodes no row (a cache commit, an encoder call) updates every row's.
    outcome(run, carry) -> (tokens [B, S], decode_step [B, G]): what the `Trace` reports.
    block_index(run, before, after, i, phase_index) -> the block step i worked on (carries before and after
      it), for captures at `Steps.block_starts()`; n_blocks(run) -> the most blocks a run has.
  """

  options: Any

  name: ClassVar[str] = "family"
  min_prompt_length: ClassVar[int] = 0
  padding_attention: ClassVar[padding.PaddingAttention] = "key"
  shift_positions: ClassVar[bool] = False
  can_finish_early: ClassVar[bool] = False
  runs_policies: ClassVar[bool] = False

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

  def phases(self, run: Run) -> tuple[Phase, ...]:
    del run
    return (Phase(steps=self.n_steps),)

  def check(self, config: ModelConfig, intervention: Intervention) -> None:
    del config, intervention

  def check_policy(self, name: str) -> None:
    """Raises ValueError (one line) when compute policy `name` cannot run with this family's options (called
    only when `runs_policies`)."""
    del name

  @property
  def policy_cache(self) -> str:
    """The KV cache a compute policy decides in (`RunLayout.cache`): the options' Fast-dLLM cache ("none",
    "prefix" or "dual"; "none" without one)."""
    return getattr(self.options, "cache", "none")

  def constants(self, run: Run, sequence: jax.Array, layout: padding.PaddingLayout) -> Any:
    del run, sequence
    return layout

  def init_carry(self, run: Run, params, sequence: jax.Array, key: jax.Array, consts: Any) -> Any:
    raise NotImplementedError

  def finished(self, run: Run, consts: Any, carry: Any, i: jax.Array, phase: Phase) -> jax.Array:
    raise NotImplementedError

  def open_phase(self, run: Run, params, consts: Any, carry: Any, istate: Any, i: jax.Array, phase: Phase):
    raise NotImplementedError

  def step(self, run: Run, params, consts: Any, carry: Any, istate: Any, i: jax.Array, phase: Phase):
    raise NotImplementedError

  def outcome(self, run: Run, carry: Any) -> tuple[jax.Array, jax.Array]:
    raise NotImplementedError

  def block_index(self, run: Run, before: Any, after: Any, i: jax.Array, phase_index: int) -> jax.Array:
    """Default: the carry's `block` after the step when it has one (a block-by-block mode that opens its
    blocks inside a phase), else the phase's index (a phase per block)."""
    del run, before, i
    block = getattr(after, "block", None)
    return jnp.asarray(phase_index if block is None else block, jnp.int32)

  def n_blocks(self, run: Run) -> int:
    return len(self.phases(run))


@dataclasses.dataclass(frozen=True)
class MaskedDiffusionFamily(Family):
  """A family whose generation starts as mask tokens (LLaDA/MMaDA, Dream): mask_id fills the sequence and
  defines the masked query group; its carry has `tokens` and `decode_step` fields."""

  mask_id: int

  @property
  def fill_id(self) -> int:
    return self.mask_id

  @property
  def query_mask_id(self) -> int:
    return self.mask_id

  def outcome(self, run: Run, carry: Any) -> tuple[jax.Array, jax.Array]:
    return carry.tokens, carry.decode_step


@dataclasses.dataclass(frozen=True)
class Run:
  """Static facts of one sampler run, handed to every family method.

  family: the decoding family; config: the model config; caller: the model call (it holds the
  statistics plan and the intervention); prompt_length: Lp; total_length: S = Lp + G; row_keys: the run's
  key is [B] keys, one per row (`dlm_jax.sampling.keys`); captures: where the hooks' captures are kept
  (None without captures).
  """

  family: Family
  config: ModelConfig
  caller: ModelCaller
  prompt_length: int
  total_length: int
  row_keys: bool = False
  captures: capture_steps.CaptureLayout | None = None


def _max_steps(phases: tuple[Phase, ...]) -> int:
  return sum(int(p.opening) + p.steps for p in phases)


def _with_defaults(output: StepOutput, batch: int, total: int) -> StepOutput:
  """The step's output with `active` (all rows) and `queries` ([0, S)) filled in when the family left them."""
  if output.active is None:
    output = output.replace(active=jnp.ones((batch,), bool))
  if output.queries is None:
    output = output.replace(queries=jnp.array([0, total], jnp.int32))
  return output


def _start(run: Run, params, sequence, prompt_mask, key):
  layout = padding.layout(prompt_mask, run.total_length, run.family.padding_attention,
                          run.family.shift_positions, sequence.shape[0])
  consts = run.family.constants(run, sequence, layout)
  return consts, run.family.init_carry(run, params, sequence, key, consts)


def _trace(run: Run, carry, outputs: StepOutput, n_steps, captured: capture_steps.CaptureBuffers | None) -> Trace:
  """The users' `Trace`: statistics squeezed to their shapes (the one place that does it)."""
  tokens, decode_step = run.family.outcome(run, carry)
  plan = run.caller.plan.stats
  bad = outputs.nonfinite  # [max_steps, B]; steps not run are False
  first_nonfinite = jnp.where(jnp.any(bad, axis=0), jnp.argmax(bad, axis=0), -1).astype(jnp.int32)
  return Trace(tokens=tokens, decode_step=decode_step, nfe=jnp.asarray(n_steps, jnp.int32),
               first_nonfinite_step=first_nonfinite,
               active_rows=outputs.active, computed_queries=outputs.queries, stats=plan.squeeze_user(outputs.stats),
               top_sinks=plan.squeeze_sinks(outputs.top_sinks), intervention_record=outputs.record,
               accepted=outputs.accepted, canvases=outputs.canvas, committed=outputs.committed,
               revoked=outputs.revoked, computed_positions=outputs.computed, keys_read=outputs.keys_read,
               policy_record=outputs.policy_record,
               prompt_length=run.prompt_length,
               captures=None if captured is None else captured.values,
               capture_steps=None if captured is None else captured.steps)


def _calls(run: Run, params, consts, phase: Phase):
  """The phase's two calls (opening, step) as functions (carry, istate, i) -> (carry, istate, StepOutput)."""
  family = run.family

  def opening(carry, istate, i):
    return family.open_phase(run, params, consts, carry, istate, i, phase)

  def step(carry, istate, i):
    return family.step(run, params, consts, carry, istate, i, phase)

  return opening, step


def _program(params, sequence, prompt_mask, key, istate, run: Run) -> Trace:
  """The whole run as one program (jitted as `_compiled`, or `_compiled_batch_invariant` on CPU)."""
  TRACE_COUNTS[run.family.name] += 1
  family, batch = run.family, sequence.shape[0]
  phases = family.phases(run)
  consts, carry = _start(run, params, sequence, prompt_mask, key)
  first = phases[0]
  probe = family.open_phase if first.opening else family.step
  shapes = jax.eval_shape(lambda c, s: _with_defaults(probe(run, params, consts, c, s, jnp.int32(0), first)[2], batch,
                                                          run.total_length),
                          carry, istate)
  n_max = _max_steps(phases)
  buffers = jax.tree.map(lambda a: jnp.zeros((n_max, *a.shape), a.dtype), shapes.replace(captures=None))
  captured = None if run.captures is None else capture_steps.init_buffers(run.captures, shapes.captures)

  def guarded(call, phase, phase_index):
    """One driver step: the family's call, its output written at index count; skipped when finished.

    The `[max_steps, ...]` buffers stay outside the `lax.cond` of a family that can finish early: a
    skipped step writes a zero output at index count, which is still unwritten (zero) then — indices at
    and after count are only written by later calls — so it changes nothing, and XLA updates the buffers
    in place instead of copying them through the conditional at every step."""
    def make_call(carry, istate, count):
      carry, new_istate, output = call(carry, istate, count)
      output = _with_defaults(output, batch, run.total_length)
      return carry, _keep_waiting_rows(run, new_istate, istate, output.active), output

    def skip(carry, istate, count):
      del count
      return carry, istate, jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)

    def run_step(state):
      before, istate, count, buffers, captured = state
      if family.can_finish_early:
        done = family.finished(run, consts, before, count, phase)
        carry, istate, output = jax.lax.cond(done, skip, make_call, before, istate, count)
        advance = jnp.where(done, 0, 1).astype(count.dtype)
      else:
        carry, istate, output = make_call(before, istate, count)
        advance = jnp.ones((), count.dtype)
      captures, output = output.captures, output.replace(captures=None)
      buffers = jax.tree.map(lambda b, o: jax.lax.dynamic_update_index_in_dim(b, o, count, 0), buffers, output)
      if captured is not None:
        captured = _keep_captures(run, captured, captures, before, carry, count, advance > 0, phase_index)
      return carry, istate, count + advance, buffers, captured

    return run_step

  state = (carry, istate, jnp.zeros((), jnp.int32), buffers, captured)
  for phase_index, phase in enumerate(phases):
    opening, step = _calls(run, params, consts, phase)
    if phase.opening:
      state = guarded(opening, phase, phase_index)(state)
    if phase.steps:
      body = guarded(step, phase, phase_index)
      state, _ = jax.lax.scan(lambda st, _: (body(st), None), state, None, length=phase.steps)
  carry, _, count, buffers, captured = state
  return _trace(run, carry, buffers, count, captured)


def _keep_waiting_rows(run: Run, new_istate, old_istate, active: jax.Array):
  """The call state after a step: `old_istate` for the rows that waited (not `active` [B]), unless the call
  decoded no row at all (a cache commit, an encoder call), which updates every row's state."""
  return run.caller.plan.keep_rows(new_istate, old_istate, active | ~jnp.any(active))


def _keep_captures(run: Run, captured: capture_steps.CaptureBuffers, captures, before, after, count, ran,
                   phase_index: int) -> capture_steps.CaptureBuffers:
  """The capture buffers after step `count` (`dlm_jax.sampling.capture_steps.write`)."""
  decode_step = run.family.outcome(run, after)[1] if run.captures.needs_decode_step else None
  block = run.family.block_index(run, before, after, count, phase_index)
  return capture_steps.write(run.captures, captured, captures, count, ran, block, decode_step)


_compiled = jax.jit(_program, static_argnames=("run",), donate_argnames=("sequence",))
_compiled_batch_invariant = jax.jit(_program, static_argnames=("run",), donate_argnames=("sequence",),
                                    compiler_options=row_by_row.CPU_COMPILER_OPTIONS)
_abstract_runs = 0
"""Nonzero while `abstract_trace` evaluates a run abstractly (`jax.eval_shape` refuses compiler options)."""


def abstract_trace(run: Callable[[], Trace]) -> Trace:
  """The `Trace` of run() as shapes (`jax.ShapeDtypeStruct` leaves), from its abstract evaluation (nothing is
  computed or compiled; e.g. `active_rows.shape[0]` is the run's step bound). A batch-invariant run is
  evaluated as the ordinary program, whose shapes are the same."""
  global _abstract_runs
  _abstract_runs += 1
  try:
    return jax.eval_shape(run)
  finally:
    _abstract_runs -= 1


def capture_bytes(run: Callable[[], Trace]) -> int:
  """The bytes a run's captures occupy in its `Trace`, from its abstract evaluation (`abstract_trace`): run() ->
  Trace, e.g. `lambda: llada.generate(params, prompt, config=..., hooks=...)`."""
  trace = abstract_trace(run)
  return sum(int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(trace.captures))


def _python_loop(params, sequence, prompt_mask, key, istate, run: Run) -> Trace:
  """The same family functions driven by a Python loop (one jitted call per step); for tests."""
  family, batch = run.family, sequence.shape[0]
  phases = family.phases(run)
  consts, carry = jax.jit(functools.partial(_start, run))(params, sequence, prompt_mask, key)
  outputs, captured = [], None
  for phase_index, phase in enumerate(phases):
    finished = jax.jit(lambda c, i, phase=phase: family.finished(run, consts, c, i, phase))
    opening = jax.jit(lambda p, k, c, s, i, phase=phase: family.open_phase(run, p, k, c, s, i, phase))
    step = jax.jit(lambda p, k, c, s, i, phase=phase: family.step(run, p, k, c, s, i, phase))
    for call in [opening] * int(phase.opening) + [step] * phase.steps:
      i = jnp.int32(len(outputs))
      if family.can_finish_early and bool(finished(carry, i)):
        continue
      before, old_istate = carry, istate
      carry, istate, output = call(params, consts, carry, istate, i)
      output = _with_defaults(output, batch, run.total_length)
      istate = _keep_waiting_rows(run, istate, old_istate, output.active)
      if run.captures is not None:
        if captured is None:
          captured = capture_steps.init_buffers(run.captures, jax.eval_shape(lambda c: c, output.captures))
        captured = _keep_captures(run, captured, output.captures, before, carry, i, jnp.bool_(True), phase_index)
      outputs.append(output.replace(captures=None))
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *outputs)
  pad = _max_steps(phases) - len(outputs)
  stacked = jax.tree.map(lambda a: jnp.concatenate([a, jnp.zeros((pad, *a.shape[1:]), a.dtype)]), stacked)
  return _trace(run, carry, stacked, len(outputs), captured)


def run_family(
    family: Family,
    params: dict,
    prompt: jax.Array | np.ndarray,
    *,
    config: ModelConfig,
    key: jax.Array | None = None,
    prompt_mask: jax.Array | np.ndarray | None = None,
    setup: RunSetup = DEFAULT_SETUP,
    **old_keywords: Any,
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
    setup: a `dlm_jax.sampling.run_setup.RunSetup`: what the run records and changes (statistics, top sinks,
      intervention, hooks) and how it executes (attention path, loop, batch invariance, compute policy).
    **old_keywords: `RunSetup`'s fields given as keywords (stats_spec=, hooks=, loop=, ...), the signature
      before it; deprecated (a DeprecationWarning), each the field of its name.
  """
  setup = fold_old_keywords("run_family", old_keywords, SAMPLER_MOVES, {"setup": setup},
                            {"setup": DEFAULT_SETUP})["setup"]
  return _run(family, params, prompt, config, key, prompt_mask, setup)


def _run(family: Family, params: dict, prompt, config: ModelConfig, key, prompt_mask, setup: RunSetup) -> Trace:
  """`run_family` after its old keywords are folded into `setup`."""
  if not isinstance(setup, RunSetup):
    raise ValueError(f"setup must be a dlm_jax.sampling.run_setup.RunSetup, got {type(setup).__name__}.")
  stats_spec, intervention, intervention_state, sink_top_k = (setup.stats_spec, setup.intervention,
                                                              setup.intervention_state, setup.sink_top_k)
  attention_impl, query_chunk, loop = setup.attention_impl, setup.query_chunk, setup.loop
  record_intervention, batch_invariant, hooks = setup.record_intervention, setup.batch_invariant, setup.hooks
  hook_values, policy = setup.hook_values, setup.policy
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
    raise ValueError(f"RunSetup.loop must be 'scan' or 'python', got {loop!r}.")
  family.check(config, intervention)
  b, lp = prompt.shape
  total = lp + family.gen_length
  if not isinstance(hooks, Hooks):
    raise ValueError(f"RunSetup.hooks must be a dlm_jax.instrument.hook_spec.Hooks, got {type(hooks).__name__}.")
  if hook_values is not None and not hooks.enabled:
    raise ValueError("RunSetup.hook_values were given without hooks; pass RunSetup(hooks=Hooks(captures=..., "
                     "edits=...)).")
  policy = _bind_policy(policy, family, config, lp, total)
  if hooks.enabled and policy.enabled and policy.layout.cache == "block":
    raise PolicyError(f"policy {policy.NAME!r} with block diffusion's cache does not run with hooks (a key-subset "
                      "call's captures are in sequence coordinates, its full call's in the block's); drop the hooks.")
  if batch_invariant and policy.enabled:  # no row gathers inside the policy's branches (replicated_rows)
    prompt, prompt_mask = replicated_rows.replicate_sharded_batch(prompt, prompt_mask)
  plan = make_plan(config, stats_spec, intervention, sink_top_k, padded=prompt_mask is not None, policy=policy)
  max_steps = _max_steps(family.phases(Run(family=family, config=config, caller=None, prompt_length=lp,
                                           total_length=total)))
  if hooks.enabled:
    hooks.check(config)
    for index, edit in enumerate(hooks.edits):
      if edit.schedule is not None:
        step_schedule.check_steps(edit.schedule, max_steps, f"Edit {index} ({edit.site})")
  call_plan = CallPlan(config, stats=plan, intervention=intervention, hooks=hooks,
                       max_steps=max_steps if hooks.enabled else 0, record_intervention=record_intervention,
                       policy=policy)
  caller = ModelCaller(plan=call_plan, mask_id=family.query_mask_id, gen_start=lp, attention_impl=attention_impl,
                       query_chunk=query_chunk, batch_invariant=batch_invariant)
  key, row_keys = keys.as_run_key(key, b)
  run = Run(family=family, config=config, caller=caller, prompt_length=lp, total_length=total, row_keys=row_keys)
  if hooks.captures:
    layout = capture_steps.CaptureLayout(
        steps=tuple((name, hooks.captures[i].steps) for name, i in hooks.capture_names(config).items()),
        max_steps=max_steps, n_blocks=family.n_blocks(run), prompt_length=lp)
    capture_steps.check_layout(layout)
    run = dataclasses.replace(run, captures=layout)
  sequence = jnp.concatenate([prompt, jnp.full((b, family.gen_length), family.fill_id, jnp.int32)], axis=1)
  state = call_plan.init_state(b, total, lp, intervention_state, hook_values, dtype=params["embed"]["embedding"].dtype)
  if loop == "python":
    runner = _python_loop
  elif batch_invariant and jax.default_backend() == "cpu" and not _abstract_runs:
    runner = _compiled_batch_invariant
  else:
    runner = _compiled
  return runner(params, sequence, prompt_mask, key, state, run=run)


def _bind_policy(policy: ComputePolicy, family: Family, config: ModelConfig, lp: int, total: int) -> ComputePolicy:
  """The policy bound to this run's `RunLayout`, after refusing (one line, a `PolicyError`) what it cannot run
  with."""
  if not isinstance(policy, ComputePolicy):
    raise ValueError(f"RunSetup.policy must be a dlm_jax.policy ComputePolicy, got {type(policy).__name__}.")
  if not policy.enabled:
    return policy
  name = policy.NAME
  try:
    if not family.runs_policies:
      raise ValueError(f"policy {name!r} runs with the samplers whose every call reads the whole sequence (LLaDA, "
                       f"MMaDA and Dream: exact, threshold or factor decoding, decoding rules) and, sparse_dllm, with "
                       f"block diffusion's cache, not with {family.name}.")
    family.check_policy(name)
    cfg_scale = getattr(family.options, "cfg_scale", 0.0)
    if cfg_scale:
      raise ValueError(f"policy {name!r} does not run with classifier-free guidance (cfg_scale={cfg_scale:g}): the "
                       "unconditional rows would need a policy state and KV cache of their own; set cfg_scale=0.")
    gen = family.gen_length
    block = getattr(family.options, "block_length", gen) or gen
    steps_per_block = max(family.n_steps // max(gen // block, 1), 1)
    window = getattr(family.options, "window", None)
    eos_cut_id = getattr(family, "eos_id", None) if getattr(family.options, "eos_truncation", False) else None
    rule = getattr(family.options, "rule", None)
    bound = policy.bind(RunLayout(seq_len=total, gen_start=lp, block_length=block, steps_per_block=steps_per_block,
                                  logit_shift=config.logit_shift, decoding_window=window, eos_cut_id=eos_cut_id,
                                  cache=family.policy_cache,
                                  decoding_rule=None if rule is None else rule.name))
    bound.check(config, family.name)
  except PolicyError:
    raise
  except ValueError as error:
    raise PolicyError(str(error)) from None
  return bound


def public_sampler(build_family: Callable[[ModelConfig, Any, Any], Family], default_options: Any, doc: str,
                   public_name: str = "generate"):
  """A family's public `generate`-style function (one signature for every family; `doc` is its docstring,
  `public_name` its name in messages).

  build_family(config, options, prompt) -> Family resolves the family's ids (raising ValueError with a
  clear message when they are missing). The function's keyword arguments after `options` are those of
  `run_family`: key, prompt_mask and the `RunSetup` (old keywords folded into it with a DeprecationWarning).
  """

  def sample(params: dict, prompt: jax.Array | np.ndarray, *, config: ModelConfig, options: Any = default_options,
             key: jax.Array | None = None, prompt_mask: jax.Array | np.ndarray | None = None,
             setup: RunSetup = DEFAULT_SETUP, **old_keywords: Any) -> Trace:
    name = f"{build_family.__module__.rsplit('.', 1)[-1]}.{public_name}"
    setup = fold_old_keywords(name, old_keywords, SAMPLER_MOVES, {"setup": setup}, {"setup": DEFAULT_SETUP})["setup"]
    return _run(build_family(config, options, prompt), params, prompt, config, key, prompt_mask, setup)

  sample.__doc__ = doc
  sample.__name__ = sample.__qualname__ = public_name
  sample.__module__ = build_family.__module__
  return sample
