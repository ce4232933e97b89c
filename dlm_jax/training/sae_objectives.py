"""Training objectives of sparse autoencoders: TopK (with the AuxK loss on dead features) and JumpReLU (L0 through
straight-through estimators), their initialisation and one optax step.

Facts carried over from the papers (no code): TopK SAEs (Gao et al. 2024, "Scaling and evaluating sparse
autoencoders"): keep the k largest pre-activations, loss = reconstruction MSE + α · AuxK, where AuxK reconstructs
the residual error x − x̂ from the top k_aux pre-activations of the features dead for `dead_after` steps
(α = 1/32), decoder rows kept at unit norm, b_dec initialised at the data mean. JumpReLU SAEs (Rajamanoharan et
al. 2024, "Jumping ahead"; Gemma Scope): a = pre · H(pre − θ) with θ = exp(log θ), loss = MSE + λ · L0, where the
Heaviside step gets the pseudo-derivative ∂H(z − θ)/∂θ = −K((z − θ)/ε)/ε (K the rectangle on [−½, ½], ε the
bandwidth), and ∂a/∂θ = −θ/ε · K((z − θ)/ε); initial threshold 0.001, bandwidth 0.001.

Inputs are scaled by one constant `scale` (so that E‖x·scale‖² = D, computed from the data before training);
`to_sae` folds it back into the weights, so the saved SAE reads raw activations (SAELens's
`fold_activation_norm_scaling_factor` does the same).

Shapes: B rows, D = d_in, F = d_sae. Parameters {W_enc [D, F], b_enc [F], W_dec [F, D], b_dec [D],
log_threshold [F] (JumpReLU)}; the state adds the optimizer state, the step, `since_fired` [F] int32 (steps
since each feature last fired) and `scale` (scalar).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dlm_jax.instrument import sae as sae_lib

TRAIN_ARCHITECTURES = ("topk", "jumprelu")


@dataclasses.dataclass(frozen=True)
class SAEObjective:
  """What is trained: architecture ("topk" / "jumprelu"), d_in, d_sae; TopK's k, k_aux (0: d_in // 2),
  aux_coefficient and dead_after (steps without firing that make a feature dead); JumpReLU's l0_coefficient,
  bandwidth and init_threshold."""

  architecture: str = "topk"
  d_in: int = 0
  d_sae: int = 0
  k: int = 8
  k_aux: int = 0
  aux_coefficient: float = 1 / 32
  dead_after: int = 200
  l0_coefficient: float = 1e-3
  bandwidth: float = 1e-3
  init_threshold: float = 1e-3

  def check(self) -> None:
    """Raises ValueError (one line) for a setting out of range."""
    if self.architecture not in TRAIN_ARCHITECTURES:
      raise ValueError(f"SAE training architecture must be one of {', '.join(TRAIN_ARCHITECTURES)}, got "
                       f"{self.architecture!r}.")
    for name in ("d_in", "d_sae", "dead_after"):
      if getattr(self, name) <= 0:
        raise ValueError(f"SAE {name} must be a positive integer, got {getattr(self, name)!r}.")
    if self.architecture == "topk" and not 1 <= self.k <= self.d_sae:
      raise ValueError(f"TopK k must be in 1..d_sae={self.d_sae}, got {self.k}.")
    if not 0 <= self.k_aux <= self.d_sae:
      raise ValueError(f"k_aux must be in 0..d_sae={self.d_sae}, got {self.k_aux}.")
    for name in ("l0_coefficient", "bandwidth", "init_threshold", "aux_coefficient"):
      if not getattr(self, name) >= 0 or (name in ("bandwidth", "init_threshold") and getattr(self, name) == 0):
        raise ValueError(f"SAE {name} must be {'> 0' if name in ('bandwidth', 'init_threshold') else '>= 0'}, got "
                         f"{getattr(self, name)!r}.")

  @property
  def aux_k(self) -> int:
    return self.k_aux or min(self.d_sae, max(1, self.d_in // 2))


def data_scale(sample: np.ndarray) -> float:
  """The constant that makes the mean squared norm of the rows of `sample` [N, D] equal D."""
  sample = np.asarray(sample, np.float64)
  return float(np.sqrt(sample.shape[1] / max(np.mean(np.sum(sample * sample, axis=1)), 1e-30)))


def init_params(objective: SAEObjective, key: jax.Array, mean: np.ndarray) -> dict[str, jax.Array]:
  """Random unit decoder rows, W_enc = W_decᵀ, b_enc 0, b_dec = `mean` [D] (of the scaled data), log θ at the
  initial threshold (JumpReLU)."""
  w_dec = jax.random.normal(key, (objective.d_sae, objective.d_in), jnp.float32)
  w_dec = w_dec / jnp.linalg.norm(w_dec, axis=-1, keepdims=True)
  params = {"W_enc": w_dec.T, "b_enc": jnp.zeros((objective.d_sae,), jnp.float32), "W_dec": w_dec,
            "b_dec": jnp.asarray(mean, jnp.float32)}
  if objective.architecture == "jumprelu":
    params["log_threshold"] = jnp.full((objective.d_sae,), np.log(objective.init_threshold), jnp.float32)
  return params


def _rectangle(z: jax.Array) -> jax.Array:
  return ((z > -0.5) & (z < 0.5)).astype(z.dtype)


@jax.custom_vjp
def _jumprelu(pre: jax.Array, threshold: jax.Array, bandwidth: float) -> jax.Array:
  return pre * (pre > threshold)


def _jumprelu_fwd(pre, threshold, bandwidth):
  return _jumprelu(pre, threshold, bandwidth), (pre, threshold, bandwidth)


def _jumprelu_bwd(residuals, g):
  pre, threshold, bandwidth = residuals
  d_threshold = -(threshold / bandwidth) * _rectangle((pre - threshold) / bandwidth) * g
  return (pre > threshold) * g, jnp.sum(d_threshold, axis=tuple(range(pre.ndim - 1))), None


_jumprelu.defvjp(_jumprelu_fwd, _jumprelu_bwd)


@jax.custom_vjp
def _step(pre: jax.Array, threshold: jax.Array, bandwidth: float) -> jax.Array:
  return (pre > threshold).astype(pre.dtype)


def _step_fwd(pre, threshold, bandwidth):
  return _step(pre, threshold, bandwidth), (pre, threshold, bandwidth)


def _step_bwd(residuals, g):
  pre, threshold, bandwidth = residuals
  d_threshold = -(1.0 / bandwidth) * _rectangle((pre - threshold) / bandwidth) * g
  return jnp.zeros_like(pre), jnp.sum(d_threshold, axis=tuple(range(pre.ndim - 1))), None


_step.defvjp(_step_fwd, _step_bwd)


def _pre(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
  return (x - params["b_dec"]) @ params["W_enc"] + params["b_enc"]


def loss_fn(params: dict[str, jax.Array], x: jax.Array, since_fired: jax.Array, objective: SAEObjective):
  """(loss, (metrics, fired [F] bool)) of a batch x [B, D] of scaled activations."""
  pre = _pre(params, x)
  if objective.architecture == "topk":
    top, index = jax.lax.top_k(pre, objective.k)
    acts = jnp.put_along_axis(jnp.zeros_like(pre), index, jax.nn.relu(top), axis=-1, inplace=False)
  else:
    threshold = jnp.exp(params["log_threshold"])
    acts = _jumprelu(pre, threshold, objective.bandwidth)
  recon = acts @ params["W_dec"] + params["b_dec"]
  error = recon - x
  mse = jnp.mean(jnp.sum(error * error, axis=-1))
  fired = jnp.any(acts > 0, axis=0)
  metrics = {"mse": mse, "l0": jnp.mean(jnp.sum(acts > 0, axis=-1).astype(jnp.float32)),
             "explained_variance": 1.0 - jnp.sum(error * error) / jnp.sum((x - jnp.mean(x, axis=0)) ** 2)}
  loss = mse
  if objective.architecture == "topk":
    dead = since_fired >= objective.dead_after
    dead_pre = jnp.where(dead, pre, -jnp.inf)
    top, index = jax.lax.top_k(dead_pre, objective.aux_k)
    aux_acts = jnp.put_along_axis(jnp.zeros_like(pre), index, jnp.where(jnp.isfinite(top), jax.nn.relu(top), 0.0),
                                  axis=-1, inplace=False)
    target = jax.lax.stop_gradient(x - recon)
    aux_error = aux_acts @ params["W_dec"] - target
    aux = jnp.where(jnp.any(dead), jnp.mean(jnp.sum(aux_error * aux_error, axis=-1)), 0.0)
    loss = loss + objective.aux_coefficient * aux
    metrics["aux_loss"] = aux
  else:
    l0 = jnp.mean(jnp.sum(_step(pre, jnp.exp(params["log_threshold"]), objective.bandwidth), axis=-1))
    loss = loss + objective.l0_coefficient * l0
  metrics["loss"] = loss
  return loss, (metrics, fired)


def make_optimizer(lr: float, steps: int, warmup: int) -> optax.GradientTransformation:
  """Adam with linear warm-up to `lr` and linear decay to 0 over the last fifth of `steps`."""
  decay_start = max(warmup, int(steps * 0.8))
  schedule = optax.join_schedules(
      [optax.linear_schedule(0.0, lr, max(warmup, 1)), optax.constant_schedule(lr),
       optax.linear_schedule(lr, 0.0, max(steps - decay_start, 1))], [max(warmup, 1), decay_start])
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adam(schedule, b1=0.9, b2=0.999))


def init_state(objective: SAEObjective, optimizer: optax.GradientTransformation, key: jax.Array, mean: np.ndarray,
               scale: float) -> dict[str, Any]:
  params = init_params(objective, key, mean)
  return {"params": params, "opt_state": optimizer.init(params), "step": jnp.zeros((), jnp.int32),
          "since_fired": jnp.zeros((objective.d_sae,), jnp.int32), "scale": jnp.asarray(scale, jnp.float32)}


def train_step(state: dict[str, Any], x: jax.Array, objective: SAEObjective, optimizer: optax.GradientTransformation):
  """One optax step on raw activations x [B, D] (scaled here by state["scale"]); decoder rows renormalised to
  unit norm after the update. Returns (state, metrics)."""
  scaled = x.astype(jnp.float32) * state["scale"]
  (_, (metrics, fired)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"], scaled,
                                                                           state["since_fired"], objective)
  updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
  params = optax.apply_updates(state["params"], updates)
  params["W_dec"] = params["W_dec"] / jnp.maximum(jnp.linalg.norm(params["W_dec"], axis=-1, keepdims=True), 1e-8)
  since_fired = jnp.where(fired, 0, state["since_fired"] + 1)
  metrics["dead_fraction"] = jnp.mean((since_fired >= objective.dead_after).astype(jnp.float32))
  metrics["grad_norm"] = optax.tree.norm(grads)
  return {**state, "params": params, "opt_state": opt_state, "step": state["step"] + 1,
          "since_fired": since_fired}, metrics


def to_sae(params: dict[str, Any], scale: float, objective: SAEObjective) -> sae_lib.SAE:
  """The trained parameters as an `SAE` on raw activations (the input scale folded into the weights)."""
  params = {k: np.asarray(v, np.float32) for k, v in params.items()}
  threshold = (np.exp(params["log_threshold"]) if objective.architecture == "jumprelu"
               else np.zeros((objective.d_sae,), np.float32))
  return sae_lib.SAE(W_enc=jnp.asarray(params["W_enc"] * scale), b_enc=jnp.asarray(params["b_enc"]),
                     W_dec=jnp.asarray(params["W_dec"] / scale), b_dec=jnp.asarray(params["b_dec"] / scale),
                     threshold=jnp.asarray(threshold), architecture=objective.architecture,
                     k=objective.k if objective.architecture == "topk" else 0)
