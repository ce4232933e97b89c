"""`RunSetup`: what a sampler run records and changes, and how it executes — every setting of a sampler
(`dlm_jax.sampling.driver.run_family` and each family's `generate`) besides its data (params, prompt, config,
options, key, prompt_mask).

    trace = llada.generate(params, prompt, config=config, options=options, key=key,
                           setup=RunSetup(stats_spec=StatsSpec(incoming=True), hooks=hooks, loop="python"))
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from dlm_jax.core.old_keywords import Moved
from dlm_jax.instrument.hook_call import HookValues
from dlm_jax.instrument.hook_spec import NO_HOOKS, Hooks
from dlm_jax.instrument.interventions import NO_INTERVENTION, Intervention
from dlm_jax.instrument.stats import NO_STATS, StatsSpec
from dlm_jax.policy.base import NO_POLICY, ComputePolicy

Loop = Literal["scan", "python"]


@dataclasses.dataclass(frozen=True, eq=False)
class RunSetup:
  """A sampler run's settings besides its data; every field but the two initial states is static.

  What the run records and changes:
    stats_spec: per-step attention statistics to return (`Trace.stats`).
    sink_top_k: also return the per-step top-k sinks (0 = off).
    intervention: attention-bias intervention applied at every step.
    intervention_state: its initial state (traced); None = `intervention.init_state(config, B, Lp + G)`.
    record_intervention: stack the intervention's per-step record into `Trace.intervention_record`.
    hooks: captures and edits of activations at named sites at every model call
      (`dlm_jax.instrument.hook_spec.Hooks`); the captures come back in `Trace.captures`.
    hook_values: their traced values (`dlm_jax.instrument.hook_call.hook_values` for [B, Lp + G]); None = the
      defaults of `hook_values` (edits everywhere with coefficient 1; raises if one needs a source).
  How it executes:
    attention_impl, query_chunk: the attention path (`dlm_jax.model.forward_inputs.Compute`).
    loop: "scan" (the compiled program) or "python" (same step function, Python loop; for tests).
    batch_invariant: run every model call one row at a time (`dlm_jax.sampling.row_by_row`), so that each
      row's tokens and statistics are bitwise those it gets in a batch of one, whatever its batch size and
      neighbours (same sampler semantics; slower, BUILD.md "Exact batch independence").
    policy: a compute policy (`dlm_jax.policy`): statistics of each call decide what the next one computes;
      `Trace.computed_positions` says what each step computed.
  """

  stats_spec: StatsSpec = NO_STATS
  sink_top_k: int = 0
  intervention: Intervention = NO_INTERVENTION
  intervention_state: Any = None
  record_intervention: bool = False
  hooks: Hooks = NO_HOOKS
  hook_values: HookValues | None = None
  attention_impl: str = "chunked"
  query_chunk: int = 128
  loop: Loop = "scan"
  batch_invariant: bool = False
  policy: ComputePolicy = NO_POLICY


DEFAULT_SETUP = RunSetup()

SAMPLER_MOVES = {field.name: Moved("setup", "RunSetup", field.name) for field in dataclasses.fields(RunSetup)}
"""The samplers' old keywords: each is the `RunSetup` field of its name."""
