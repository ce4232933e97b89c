"""How the experiment binaries decode: the sampler call over a batch of prompts, the model's own intervention,
per-item PRNG keys, the finiteness check and the warning for a decoding mode a sampler ignores.

The settings, their per-model values (`DecodeSettings`, `model_settings`, with the binaries' defaults, padding
and confidence ranking) and the options they become are the library's decoding session
(`dlm_jax.session.decode_settings`, `dlm_jax.session.sampler_options`); the decoding modes are
`dlm_jax.session.decoding_mode`, their flags `experiments.common.decoding_flags`.

PRNG keys. Each item's key is derived from --seed and the item's id (`item_key`), never from its batch:
every sampler call gets one key per row (`batch_key`; `dlm_jax.sampling.keys`).
"""

from __future__ import annotations

import dataclasses
import functools
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from dlm_jax.sampling import registry
from dlm_jax.session import sampler_options
from dlm_jax.session.checkpoint_bundle import Model
from dlm_jax.session.decoding_mode import DecodingMode
from experiments.common import devices
from experiments.common.cli import UserError
from experiments.common import prompts as prompts_lib
from experiments.common.prompts import Prompts


def item_key_number(item_id: str) -> int:
  """A stable 31-bit number of an item id (its CRC-32), for seeding per-item randomness."""
  return zlib.crc32(item_id.encode("utf-8")) & 0x7FFFFFFF


def item_key(seed: int, item_id: str) -> jax.Array:
  """The PRNG key of one item: fold_in(key(seed), item_key_number(id))."""
  return jax.random.fold_in(jax.random.key(seed), item_key_number(item_id))


def batch_key(seed: int, item_ids: list[str]) -> jax.Array:
  """The key of a sampler call over rows holding `item_ids`: one `item_key` per row ([B] keys)."""
  numbers = jnp.asarray([item_key_number(i) for i in item_ids], jnp.uint32)
  return jax.vmap(lambda n: jax.random.fold_in(jax.random.key(seed), n))(numbers)


def base_intervention(model: Model):
  """The intervention every call of this model needs (the extra sink token), or None."""
  if model.sink_token == "none":
    return None
  from dlm_jax.instrument import interventions  # pylint: disable=import-outside-toplevel
  return interventions.SinkToken("front")


def combined_intervention(model: Model, intervention=None):
  """The model's own intervention (the extra sink token, if any) composed with `intervention` (first the
  sink token, then the other: a `Compose` whose state is (sink state, other state))."""
  from dlm_jax.instrument import interventions  # pylint: disable=import-outside-toplevel
  parts = [p for p in (base_intervention(model), intervention) if p is not None]
  if not parts:
    return interventions.NO_INTERVENTION
  return parts[0] if len(parts) == 1 else interventions.Compose(tuple(parts))


def sink_token_kept(model: Model, policy):
  """The compute policy with the model's extra sink token (position 0) always among a key subset's kept keys:
  `keep_first` raised to 1 for a model trained with one (a policy without that knob keeps every key)."""
  if model.sink_token == "none" or not hasattr(policy, "keep_first"):
    return policy
  return dataclasses.replace(policy, keep_first=max(policy.keep_first, 1))


def check_finite(trace, rows: list[str] | None = None) -> None:
  """Refuses (a one-line `UserError` naming the row and the step) a `Trace` whose logits went NaN or
  infinite at some step (`Trace.first_nonfinite_step`, gathered from every process); rows: names of the
  batch rows."""
  from dlm_jax.runtime import distributed  # pylint: disable=import-outside-toplevel
  from dlm_jax.sampling.trace import nonfinite_message  # pylint: disable=import-outside-toplevel
  steps = trace.first_nonfinite_step
  if not isinstance(steps, np.ndarray):  # a device array, possibly sharded over processes
    steps = distributed.to_host(steps)
  message = nonfinite_message(steps, rows)
  if message is not None:
    raise UserError(message)


def masker_state(model: Model, intervention, masker, batch: int, total: int, k: int, valid):
  """Initial state of `intervention` (the masker alone, or `combined_intervention`'s Compose) with the
  masker's K = k and the valid keys [batch, total] bool eligible as sinks."""
  from dlm_jax.instrument import interventions  # pylint: disable=import-outside-toplevel
  state = intervention.init_state(model.config, batch, total)

  def set_k(s):
    return masker.with_top_k(s, k).replace(eligible=jnp.asarray(valid))

  if isinstance(intervention, interventions.Compose):
    return (state[0], set_k(state[1]))
  return set_k(state)


def sampler(model: Model, values: dict[str, Any], prompts: Prompts, runtime: devices.Runtime, numerics, *,
            key: jax.Array, stats_spec=None, intervention=None, intervention_state=None, params=None):
  """The model's sampler on a batch (placed on the mesh when there is one) with everything bound but its
  activation hooks: a `functools.partial` sample(hooks=..., hook_values=...) -> `Trace` (defaults: none; its
  first bound argument is the weights), without the finiteness check of `generate` (so that `jax.eval_shape`
  can run it, e.g. `capture_budget.check`).

  values: `dlm_jax.session.model_settings`; intervention: the complete intervention (see
  `combined_intervention`); None = the model's own; params: the weights (default the model's; e.g. abstract
  ones under `jax.eval_shape`)."""
  from dlm_jax.instrument.stats import NO_STATS  # pylint: disable=import-outside-toplevel
  from dlm_jax.policy.base import NO_POLICY  # pylint: disable=import-outside-toplevel
  from dlm_jax.sampling.run_setup import RunSetup  # pylint: disable=import-outside-toplevel
  if intervention is None:
    intervention = combined_intervention(model)
  prompt = devices.place_batch(prompts.ids, runtime)
  mask = None if prompts.mask is None else devices.place_batch(prompts.mask, runtime)
  if intervention_state is not None:
    intervention_state = devices.replicate(intervention_state, runtime)
  options = sampler_options.from_values(values, model.config, mask is not None, tuple(prompts_lib.end_ids(model)))
  policy = sink_token_kept(model, DecodingMode.from_record(values).compute_policy())
  setup = RunSetup(stats_spec=stats_spec or NO_STATS, intervention=intervention,
                   intervention_state=intervention_state, attention_impl=numerics.attention_impl,
                   query_chunk=numerics.query_chunk, batch_invariant=numerics.batch_invariant,
                   policy=policy if policy.enabled else NO_POLICY)
  return functools.partial(_with_hooks(model.decoder.generate), model.params if params is None else params, prompt,
                           config=model.config, options=options, key=key, prompt_mask=mask, setup=setup)


def _with_hooks(generate):
  """generate(params, prompt, ..., setup=...) taking the hooks and their values apart from the rest of its
  `RunSetup`: sample(params, prompt, *, setup, hooks=None, hook_values=None, **data)."""

  def sample(params, prompt, *, setup, hooks=None, hook_values=None, **data):
    from dlm_jax.instrument.hook_spec import NO_HOOKS  # pylint: disable=import-outside-toplevel
    setup = dataclasses.replace(setup, hooks=NO_HOOKS if hooks is None else hooks, hook_values=hook_values)
    return generate(params, prompt, setup=setup, **data)

  return sample


def generate(model: Model, values: dict[str, Any], prompts: Prompts, runtime: devices.Runtime, numerics, *,
             key: jax.Array, stats_spec=None, intervention=None, intervention_state=None, hooks=None,
             hook_values=None):
  """Runs the model's sampler on a batch (`sampler`) with activation hooks if given (`dlm_jax.instrument`);
  returns the `Trace`, refused when its logits went non-finite (`check_finite`)."""
  from dlm_jax.instrument.hook_spec import NO_HOOKS  # pylint: disable=import-outside-toplevel
  trace = sampler(model, values, prompts, runtime, numerics, key=key, stats_spec=stats_spec,
                  intervention=intervention, intervention_state=intervention_state)(
                      hooks=NO_HOOKS if hooks is None else hooks, hook_values=hook_values)
  check_finite(trace, [f"{model.label} batch row {row}" for row in range(prompts.ids.shape[0])])
  return trace


def warn_if_unused(mode: DecodingMode, sampler: str, label: str) -> None:
  """Logs that a non-exact mode does not apply to a sampler without modes, the autoregressive or the
  DiffusionGemma one (decoded as usual)."""
  if mode.exact or registry.get(sampler).has_modes:
    return
  if registry.get(sampler).kind == "causal":
    usual = "the autoregressive sampler decodes as usual (one token per call, exact KV cache)"
  else:
    usual = f"the {sampler} sampler decodes as usual (entropy-bound acceptance, exact prompt cache)"
  logging.warning("%s: --decoding=%s applies to the masked diffusion samplers; %s", label, mode.decoding, usual)
