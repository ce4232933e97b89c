"""`Trace`: what every sampler returns."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class Trace:
  """The result of one sampler run (a pytree; `prompt_length` is static).

  Attributes:
    tokens: [B, S_total] int32, the final sequence: the (left-padded) prompt followed by the generation.
    decode_step: [B, G] int32, for each generated position the 0-based step at which it stopped holding
      the mask token (diffusion samplers; the last such step if a token was re-masked), or the step that
      produced it (autoregressive); -1 if it never did.
    nfe: scalar int32, the number of model evaluations (forward calls; a CFG step runs the conditional and
      unconditional sequences as one 2B batch and counts once; steps skipped by an early stop do not count).
      It is also the number of steps run: indices 0..nfe−1 of every per-step buffer below are valid, the
      rest (up to the sampler's step bound, `max_steps`) are zeros.
    active_rows: [max_steps, B] bool, the rows each step decoded for: all rows at every step run, except
      in modes where rows of a batch finish a block at different steps (threshold decoding, block
      diffusion): a row that is done waits, unchanged, while its model call still runs with the batch; and
      no row at block diffusion's cache calls (the prefill, a block's commit), which decode nothing.
      False after step nfe − 1.
    computed_queries: [max_steps, 2] int32, the sequence positions [start, stop) whose queries each step
      computed: [0, S) for a whole-sequence step; the block and what follows it (prefix cache), the block
      (dual cache, block diffusion) or the fed tokens (autoregressive) otherwise; under a compute policy the
      span of `computed_positions` over the rows. Statistics sum over these queries (and attend over all S
      keys, cached ones included).
    stats: None, or the user's statistics stacked over steps, in the users' shapes
      (`dlm_jax.instrument.stats.squeeze`): {"incoming_attention": [max_steps, L', B, (Q,) (N,) S] — the Q
      axis only with query groups, the head axis only per head — "value_norms": [max_steps, L', B, K, S],
      and with `StatsSpec.routing` "routed_experts" / "routing_weights": [max_steps, L', B, S, k] (the
      router's choice at each sequence position a step computed; −1 / 0 elsewhere and in dense layers) and
      "expert_load": [max_steps, L', B, E] (tokens per expert in the step)}.
    top_sinks: None, or [max_steps, L', B, (N,) k] int32, the k keys with the most incoming attention (all
      queries) at each step, per layer (and head when the stats are per head), among the valid keys.
    intervention_record: None, or (with `record_intervention=True`) the intervention's per-step record
      stacked over steps (`Intervention.record`; e.g. the keys `MaskPreviousSinks` masked at each step,
      [steps, L, B, N, S] bool).
    accepted: None, or [max_steps, B, C] bool (DiffusionGemma): the canvas positions each decoder step
      accepted (took the sample; the others were renoised); all False at the encoder calls and for rows
      that waited.
    canvases: None, or [max_steps, B, C] int32 (DiffusionGemma): the canvas each decoder step read — the
      tokens of its queries (accepted samples and renoised ids), which `tokens` does not show; zeros at the
      encoder calls.
      Under a decoding rule (`dlm_jax.sampling.llada_rules`): [max_steps, B, G], the generated tokens each
      step read (drafts a later step revoked included).
    first_nonfinite_step: [B] int32, the first step at which the row's logits held a NaN or an infinity
      (computed in the program from every model call's output), −1 when none did; its tokens after that
      step are meaningless (`nonfinite_message`).
    captures: None, or the activations the run's hooks captured, by name ("blocks.3.hook_resid_pre", …;
      `dlm_jax.instrument.hook_spec.Capture`): [n, B, S | P, ...] over the capture's kept steps in sequence
      coordinates (or [B, S, ...] for `Steps.decoded()`), the conditional half under CFG.
    capture_steps: None, or {name: [n] int32}, the step number of each kept slot (−1: never filled, e.g. a
      step after an early stop); absent for `Steps.decoded()` captures (`decode_step` says when).
    committed: None, or [max_steps, B, G] bool (the decoding rules of `dlm_jax.sampling.llada_rules`): the
      generated positions each step committed a token to; a position committed more than once was revoked
      in between.
    revoked: None, or [max_steps, B, G] bool (with `committed`): the generated positions each step re-masked
      (WINO's narrow-out; never for the other rules). `first_commit_step` and `revocations` read them per position.
    computed_positions: None, or [max_steps, B, S] bool (a run under a compute policy, `dlm_jax.policy`): the
      sequence positions whose queries each step computed (every position at a full call); `captures` hold
      zeros where a step computed nothing (per layer under a layer refresh or reuse: docs/guides/compute_policies.md).
    keys_read: None, or [max_steps, B] float32 (with `computed_positions`): the keys each computed query read
      at each step, averaged over the layers (S at a full call).
    policy_record: None, or the policy's per-step record stacked [max_steps, ...] (`ComputePolicy.record`, read
      after each call; Sparse-dLLM: [max_steps, B, L, n] the kept keys of each layer).
    prompt_length: Lp, the number of prompt positions (static).
  """

  tokens: jax.Array
  decode_step: jax.Array
  nfe: jax.Array
  active_rows: jax.Array | None = None
  computed_queries: jax.Array | None = None
  stats: dict[str, jax.Array] | None = None
  top_sinks: jax.Array | None = None
  intervention_record: Any = None
  accepted: jax.Array | None = None
  canvases: jax.Array | None = None
  first_nonfinite_step: jax.Array | None = None
  captures: dict[str, Any] | None = None
  capture_steps: dict[str, jax.Array] | None = None
  committed: jax.Array | None = None
  revoked: jax.Array | None = None
  computed_positions: jax.Array | None = None
  keys_read: jax.Array | None = None
  policy_record: Any = None
  prompt_length: int = struct.field(pytree_node=False, default=0)

  @property
  def row_nfe(self) -> jax.Array:
    """[B] int32, the model evaluations each row decoded with (equals `nfe` unless rows can wait or the
    sampler makes cache calls that decode no row)."""
    return jnp.sum(self.active_rows, axis=0, dtype=jnp.int32)

  @property
  def revocations(self) -> jax.Array | None:
    """[B, G] int32, how many times each generated position was re-masked (None without `revoked`)."""
    return None if self.revoked is None else jnp.sum(self.revoked, axis=0, dtype=jnp.int32)

  @property
  def first_commit_step(self) -> jax.Array | None:
    """[B, G] int32, the step a position was first committed at (−1 never; None without `committed`);
    `decode_step` is the last."""
    if self.committed is None:
      return None
    return jnp.where(jnp.any(self.committed, axis=0), jnp.argmax(self.committed, axis=0), -1).astype(jnp.int32)

  @property
  def generated(self) -> jax.Array:
    """[B, G] the generated tokens."""
    return self.tokens[:, self.prompt_length:]


def nonfinite_message(first_nonfinite_step, rows: list[str] | None = None) -> str | None:
  """One line naming the first row whose logits went non-finite and the step, or None when no row did.
  first_nonfinite_step: [B] (`Trace.first_nonfinite_step`, on the host); rows: names of the rows (default
  "row b")."""
  steps = [int(s) for s in first_nonfinite_step]
  bad = [b for b, s in enumerate(steps) if s >= 0]
  if not bad:
    return None
  b = min(bad, key=lambda r: (steps[r], r))
  name = rows[b] if rows is not None else f"row {b}"
  return (f"the model's logits hold NaN or infinite values from step {steps[b]} on for {name} ({len(bad)} of "
          f"{len(steps)} rows affected); the weights or the activations are not finite, so the tokens are "
          "meaningless")
