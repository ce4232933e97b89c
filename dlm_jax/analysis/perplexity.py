"""Teacher-forced perplexity of a causal model with and without sink masking (one forward per condition).

Texts are right-padded into one batch (a causal model never sees later positions, so right padding does
not change the real tokens' predictions) and only real next-token targets are scored. Conditions:

  none           the plain forward;
  first          key 0 (the first token, the classic ARM sink) removed from every query but itself;
  topK_static    per (layer, head), the K keys with the most incoming attention from the real queries of
                 the unmasked pass removed from every query but themselves (the static analogue of the
                 paper's top-K masking; one compiled program serves every K).

It composes `call_plan.intervened_forward`, `sink_selection.top_k_sinks` and `training.token_cross_entropy`;
`experiments.sink_masking_eval` reports it beside the decoding results.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dlm_jax.instrument import sink_selection
from dlm_jax.instrument import interventions
from dlm_jax.sampling.call_plan import intervened_forward
from dlm_jax.config import ModelConfig
from dlm_jax.instrument.stats import StatsSpec
from dlm_jax.training import token_cross_entropy

_FIRST = interventions.MaskKeys(spare_self=True)
_PER_HEAD = interventions.MaskKeys(per_layer_head=True, spare_self=True)


def _nll(logits: jax.Array, tokens: jax.Array, real: jax.Array) -> jax.Array:
  """[B] summed next-token NLL over real targets: logits [B, T, V] at i predict tokens[:, i+1]."""
  ce = token_cross_entropy(logits[:, :-1], tokens[:, 1:])
  return jnp.sum(jnp.where(real[:, 1:], ce, 0.0), axis=1)


@functools.partial(jax.jit, static_argnames=("config", "attention_impl"))
def unmasked_pass(params, tokens, real, *, config: ModelConfig, attention_impl: str = "chunked"):
  """(nll [B], incoming [L, B, N, S] from the real queries) of the plain forward."""
  spec = StatsSpec(incoming_attention=True, per_head=True, query_groups=1)
  output, _ = intervened_forward(
      params, tokens, interventions.NO_INTERVENTION, (), config=config, stats_spec=spec,
      query_weights=real[:, None, :].astype(jnp.float32), attention_impl=attention_impl)
  return _nll(output.logits, tokens, real), output.incoming_attention[:, :, 0]


@functools.partial(jax.jit, static_argnames=("config", "per_head", "attention_impl"))
def masked_pass(params, tokens, real, masked, *, config: ModelConfig, per_head: bool,
                attention_impl: str = "chunked"):
  """nll [B] with the keys `masked` ([B, S], or [L, B, N, S] when per_head) hidden from other queries."""
  intervention = _PER_HEAD if per_head else _FIRST
  output, _ = intervened_forward(params, tokens, intervention, masked, config=config,
                                               attention_impl=attention_impl)
  return _nll(output.logits, tokens, real)


def condition_names(top_ks) -> list[str]:
  return ["none", "first"] + [f"top{k}_static" for k in top_ks if k > 0]


def perplexity_conditions(params, tokens: np.ndarray, real: np.ndarray, top_ks, *, config: ModelConfig,
                          attention_impl: str = "chunked") -> dict[str, np.ndarray]:
  """{condition: nll [B]} for right-padded tokens [B, T] with real [B, T] bool (module docstring)."""
  tokens, real = jnp.asarray(tokens, jnp.int32), jnp.asarray(real, bool)
  nll, incoming = unmasked_pass(params, tokens, real, config=config, attention_impl=attention_impl)
  out = {"none": np.asarray(nll)}
  first = jnp.zeros(tokens.shape, bool).at[:, 0].set(True)
  out["first"] = np.asarray(masked_pass(params, tokens, real, first, config=config, per_head=False,
                                        attention_impl=attention_impl))
  for k in top_ks:
    if k <= 0:
      continue
    masked = sink_selection.top_k_sinks(incoming, k, candidates=real[None, :, None, :])
    out[f"top{k}_static"] = np.asarray(masked_pass(params, tokens, real, masked, config=config, per_head=True,
                                                   attention_impl=attention_impl))
  return out
