"""Attribution patching across the steps of a diffusion run: a gradient per step instead of a patched run
per (layer, step) cell.

What it is. For a corrupted LLaDA / Dream run decoded over the whole sequence (exact decoding, no KV cache),
step s's model call reads the sequence the run held before step s: the final tokens with every generated
position decoded at a step >= s (or never) still holding the mask token (`sequences_before_steps`, from
`Trace.decode_step`). For a metric m of step s's own logits (e.g. the logit difference at the answer
position), `site_gradients` differentiates m with respect to an additive edit of a site at every layer,
`Edit(site, "add", source="values")` with zero values, through `dlm_jax.model.forward` — one backward pass
per step — and

    attribution[s, l] = Σ_{positions, features} (clean_act[s, l] − corrupt_act[s, l]) · ∂m_s/∂act[s, l]

where clean_act / corrupt_act are the site's values in the clean and the corrupted run at step s (captured
at every step).

What it approximates. The first-order Taylor expansion of the IMMEDIATE effect of patching: replacing the
corrupted run's site at layer l, step s only (every position) by the clean run's, and reading step s's own
logits — m_s(patched) − m_s(corrupted). It does not see what the patch does to later steps (the tokens it
changes and the steps after s), which real patching with the metric read at the answer's decode step
does; and it is linear, so it misses saturation (large patches of the residual stream).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from dlm_jax.config import ModelConfig
from dlm_jax.instrument import sites
from dlm_jax.instrument.hook_call import HookCall, hook_values
from dlm_jax.instrument.hook_spec import Edit, Hooks
from dlm_jax.core.old_keywords import fold_old_keywords
from dlm_jax.model.forward_inputs import FORWARD_MOVES, NO_INSTRUMENTS
from dlm_jax.model import forward


def sequences_before_steps(tokens: np.ndarray, decode_step: np.ndarray, prompt_length: int, mask_id: int,
                          steps: np.ndarray) -> np.ndarray:
  """[n, B, S] the sequence of a whole-sequence diffusion run before each of `steps` [n]: tokens [B, S] (the
  final sequence) with the generated positions whose decode_step [B, G] is >= that step, or −1 (never
  decoded), set to mask_id."""
  tokens, decode_step = np.asarray(tokens), np.asarray(decode_step)
  steps = np.asarray(steps)[:, None, None]
  pending = (decode_step[None] >= steps) | (decode_step[None] < 0)
  generated = np.where(pending, mask_id, tokens[None, :, prompt_length:])
  prompt = np.broadcast_to(tokens[None, :, :prompt_length], (len(steps[:, 0, 0]), *tokens[:, :prompt_length].shape))
  return np.concatenate([prompt, generated], axis=2).astype(np.int32)


def site_gradients(params, sequence: jax.Array, metric: Callable[[jax.Array], jax.Array], *, config: ModelConfig,
                   site: str, layers: tuple[int, ...] | None = None, **forward_kwargs) -> tuple[jax.Array, jax.Array]:
  """(metric [B], gradient [Le, B, S, F...]) of a forward call on sequence [B, S]: metric(logits [B, S, V]) -> [B]
  per row, differentiated (one backward pass) with respect to an additive edit of `site` at `layers` (None:
  every layer with the site) that is zero, i.e. with respect to the site's values themselves. Rows are
  independent, so row b's gradient is that of metric[b]. forward_kwargs go to `forward` (positions, readout,
  compute; instruments: a `CallInstruments` whose bias and statistics the call uses, its hooks replaced)."""
  old = {name: forward_kwargs.pop(name) for name in ("bias", "stats_spec", "query_weights") if name in forward_kwargs}
  instruments = forward_kwargs.pop("instruments", NO_INSTRUMENTS)
  instruments = fold_old_keywords("site_gradients", old, FORWARD_MOVES, {"instruments": instruments},
                                  {"instruments": NO_INSTRUMENTS})["instruments"]
  hooks = Hooks(edits=(Edit(site, "add", layers=layers, source="values"),))
  resolved = hooks.resolved_layers(config, hooks.edits[0])
  feature = sites.feature_shape(config, hooks.edits[0].site, resolved[0])
  b, s = sequence.shape

  def objective(values):
    call = HookCall(hooks=hooks, values=hook_values(hooks, config, b, s, edits={
        0: dict(values=values, value_steps=jnp.zeros((1,), jnp.int32))}))
    m = metric(forward(params, sequence, config=config, instruments=instruments.replace(hooks=call),
                       **forward_kwargs).logits)
    return jnp.sum(m), m

  zeros = jnp.zeros((1, len(resolved), b, s, *feature), jnp.float32)
  gradient, m = jax.grad(objective, has_aux=True)(zeros)
  return m, gradient[0]


def logit_difference_at(position: jax.Array, clean_token: jax.Array, corrupted_token: jax.Array
                        ) -> Callable[[jax.Array], jax.Array]:
  """metric(logits [B, S, V]) -> [B]: logit[clean_token] − logit[corrupted_token] at each row's position
  [B] (the position whose logits predict the answer: the answer position minus the model's logit shift)."""
  def metric(logits):
    at = jnp.take_along_axis(logits, position[:, None, None], axis=1)[:, 0]
    return (jnp.take_along_axis(at, clean_token[:, None], axis=1)
            - jnp.take_along_axis(at, corrupted_token[:, None], axis=1))[:, 0]
  return metric


def attribution(gradient: np.ndarray, clean: np.ndarray, corrupted: np.ndarray) -> np.ndarray:
  """[Le, B]: Σ over positions and features of (clean − corrupted) · gradient, all [Le, B, S, F...]."""
  delta = (np.asarray(clean, np.float64) - np.asarray(corrupted, np.float64)) * np.asarray(gradient, np.float64)
  return delta.reshape(delta.shape[0], delta.shape[1], -1).sum(-1)
