"""Linear probes: ridge regression and L2-regularised logistic regression in JAX, held-out metrics with
item-clustered bootstrap confidence intervals.

Features are standardised with the training rows' mean and standard deviation (a constant feature is left
centred, divided by 1). Fits take per-row weights (0 = a padding row): callers pad their rows to a few
fixed sizes so that one compiled program serves many cells of a grid.

Ridge (`fit_ridge`): minimises Σ w_i (y_i − b − x_i·β)² + λ‖β‖², intercept b not penalised, solved in
closed form through the SVD of the weighted, centred design (β = V diag(s / (s² + λ)) Uᵀ ỹ), which equals
the normal equations' (XᵀX + λI)⁻¹Xᵀy and scikit-learn's `Ridge(alpha=λ)`.

Logistic (`fit_logistic`): minimises Σ w_i CE(y_i, softmax(W x_i + b)) + (λ/2)‖W‖² (binary: one logit, the
sigmoid), intercept not penalised — scikit-learn's `LogisticRegression(C=1/λ)` objective — with optax's
L-BFGS (zoom line search) until the gradient's largest entry is below `tol` or `max_iter` iterations.

Metrics (`accuracy`, `auc`, `r2`) and `bootstrap_ci`: the percentile interval of the metric over `n_boot`
resamples of the held-out *items* with replacement (all rows of a drawn item come along, so rows of one
item, which are not independent, count as one draw), seed fixed.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax


@dataclasses.dataclass(frozen=True)
class Standardizer:
  """mean [D], scale [D] of the training rows (weights > 0)."""

  mean: np.ndarray
  scale: np.ndarray

  @classmethod
  def fit(cls, x: np.ndarray, weights: np.ndarray | None = None) -> Standardizer:
    x = np.asarray(x, np.float64)
    w = np.ones(len(x)) if weights is None else np.asarray(weights, np.float64)
    mean = (w[:, None] * x).sum(0) / w.sum()
    std = np.sqrt((w[:, None] * (x - mean) ** 2).sum(0) / w.sum())
    return cls(mean.astype(np.float32), np.where(std > 1e-8, std, 1.0).astype(np.float32))

  def __call__(self, x: np.ndarray) -> np.ndarray:
    return ((np.asarray(x, np.float32) - self.mean) / self.scale).astype(np.float32)


@jax.jit
def _ridge(x, y, w, l2):
  """x [N, D], y [N], w [N], l2 scalar -> (beta [D], intercept)."""
  total = jnp.sum(w)
  mx = jnp.sum(w[:, None] * x, 0) / total
  my = jnp.sum(w * y) / total
  root = jnp.sqrt(w)
  xc, yc = root[:, None] * (x - mx), root * (y - my)
  u, s, vt = jnp.linalg.svd(xc, full_matrices=False)
  beta = vt.T @ ((s / (s * s + l2)) * (u.T @ yc))
  return beta, my - mx @ beta


def fit_ridge(x: np.ndarray, y: np.ndarray, l2: float, weights: np.ndarray | None = None) -> tuple[np.ndarray, float]:
  """Ridge regression (module docstring): x [N, D], y [N] -> (coefficients [D], intercept)."""
  w = np.ones(len(x), np.float32) if weights is None else np.asarray(weights, np.float32)
  beta, b = _ridge(jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32), jnp.asarray(w), jnp.float32(l2))
  return np.asarray(beta), float(b)


def _logistic_loss(params, x, y, w, l2, binary: bool):
  coef, bias = params
  logits = x @ coef + bias  # [N, K'] (K' = 1 binary)
  if binary:
    z = logits[:, 0]
    ce = jnp.logaddexp(0.0, z) - y * z
  else:
    ce = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, y[:, None].astype(jnp.int32), -1)[:, 0]
  return jnp.sum(w * ce) + 0.5 * l2 * jnp.sum(coef * coef)


@functools.partial(jax.jit, static_argnames=("n_classes", "max_iter"))
def _logistic(x, y, w, l2, tol, *, n_classes: int, max_iter: int):
  binary = n_classes == 2
  k = 1 if binary else n_classes
  params = (jnp.zeros((x.shape[1], k), jnp.float32), jnp.zeros((k,), jnp.float32))
  loss = functools.partial(_logistic_loss, x=x, y=y, w=w, l2=l2, binary=binary)
  solver = optax.lbfgs()
  value_and_grad = optax.value_and_grad_from_state(loss)

  def step(carry):
    params, state, i, _ = carry
    value, grad = value_and_grad(params, state=state)
    updates, state = solver.update(grad, state, params, value=value, grad=grad, value_fn=loss)
    params = optax.apply_updates(params, updates)
    return params, state, i + 1, optax.tree.norm(grad, ord=jnp.inf)

  def going(carry):
    return (carry[2] < max_iter) & (carry[3] > tol)

  params, _, iters, _ = jax.lax.while_loop(going, step, (params, solver.init(params), 0, jnp.float32(jnp.inf)))
  grad_max = optax.tree.norm(jax.grad(loss)(params), ord=jnp.inf)
  return params, iters, grad_max


@dataclasses.dataclass(frozen=True)
class LogisticFit:
  """coef [D, K'] and intercept [K'] (K' = 1 for two classes, else K), the iterations run and the final
  gradient's largest entry (converged when below the fit's tol)."""

  coef: np.ndarray
  intercept: np.ndarray
  iterations: int
  grad_max: float

  def scores(self, x: np.ndarray) -> np.ndarray:
    """[N, K'] logits."""
    return np.asarray(x, np.float32) @ self.coef + self.intercept

  def predict(self, x: np.ndarray) -> np.ndarray:
    s = self.scores(x)
    return (s[:, 0] > 0).astype(np.int64) if s.shape[1] == 1 else np.argmax(s, -1)


def fit_logistic(x: np.ndarray, y: np.ndarray, n_classes: int, l2: float, weights: np.ndarray | None = None,
                 max_iter: int = 500, tol: float = 1e-4) -> LogisticFit:
  """Logistic regression (module docstring): x [N, D], y [N] class indices in [0, n_classes)."""
  if n_classes < 2:
    raise ValueError(f"a logistic probe needs at least two classes, got {n_classes}.")
  w = np.ones(len(x), np.float32) if weights is None else np.asarray(weights, np.float32)
  (coef, bias), iters, grad_max = _logistic(jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32 if n_classes == 2
                                                                                      else jnp.int32),
                                            jnp.asarray(w), jnp.float32(l2), jnp.float32(tol), n_classes=n_classes,
                                            max_iter=max_iter)
  return LogisticFit(np.asarray(coef), np.asarray(bias), int(iters), float(grad_max))


def accuracy(y: np.ndarray, predicted: np.ndarray) -> float:
  return float(np.mean(np.asarray(y) == np.asarray(predicted)))


def auc(y: np.ndarray, score: np.ndarray) -> float:
  """Area under the ROC curve of binary labels y by score (ties count one half); NaN with one class."""
  y = np.asarray(y).astype(bool)
  score = np.asarray(score, np.float64)
  n_pos, n_neg = int(y.sum()), int((~y).sum())
  if n_pos == 0 or n_neg == 0:
    return float("nan")
  order = np.argsort(score, kind="mergesort")
  ranks = np.empty(len(score))
  sorted_scores = score[order]
  starts = np.r_[0, np.flatnonzero(np.diff(sorted_scores)) + 1]
  ends = np.r_[starts[1:], len(score)]
  for a, b in zip(starts, ends):
    ranks[order[a:b]] = (a + b + 1) / 2.0
  return float((ranks[y].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def r2(y: np.ndarray, predicted: np.ndarray) -> float:
  """Coefficient of determination 1 − SS_res / SS_tot (NaN when y is constant)."""
  y = np.asarray(y, np.float64)
  ss_tot = np.sum((y - y.mean()) ** 2)
  if ss_tot == 0:
    return float("nan")
  return float(1.0 - np.sum((y - np.asarray(predicted, np.float64)) ** 2) / ss_tot)


def bootstrap_ci(metric: Callable[[np.ndarray], float], groups: np.ndarray, n_boot: int = 200, seed: int = 0,
                 level: float = 0.95) -> tuple[float, float]:
  """The percentile interval of metric(row indices) over resamples of the groups (items) with replacement
  (module docstring); NaN resamples (e.g. one class drawn) are dropped; (NaN, NaN) when all are."""
  groups = np.asarray(groups)
  names, inverse = np.unique(groups, return_inverse=True)
  members = [np.flatnonzero(inverse == g) for g in range(len(names))]
  rng = np.random.default_rng(seed)
  values = []
  for _ in range(n_boot):
    drawn = rng.integers(0, len(names), len(names))
    value = metric(np.concatenate([members[g] for g in drawn]))
    if np.isfinite(value):
      values.append(value)
  if not values:
    return float("nan"), float("nan")
  alpha = (1 - level) / 2
  return float(np.quantile(values, alpha)), float(np.quantile(values, 1 - alpha))
