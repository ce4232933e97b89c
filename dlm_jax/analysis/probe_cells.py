"""One cell of a probe grid: split by item, standardise, fit (`dlm_jax.analysis.probes`), score the held-out
items with a bootstrap interval.

Kinds: "regression" (ridge; R²), "binary" (logistic; AUC, and accuracy), "multiclass" (softmax logistic over
`n_classes` fixed classes; accuracy). The training rows are those of items not in `test_items`, at most
`max_train_rows` of them (a fixed-seed sample), padded with zero-weight rows to the next power of two (at
least 64) so cells of a grid share compiled programs. Chance levels: R² 0, AUC 0.5, the held-out share of the
training rows' most common class for accuracy.
"""

from __future__ import annotations

import numpy as np

from dlm_jax.analysis import probes

KINDS = ("regression", "binary", "multiclass")
METRICS = {"regression": "r2", "binary": "auc", "multiclass": "accuracy"}


def split_items(items: np.ndarray, test_fraction: float, seed: int) -> np.ndarray:
  """The held-out item indices: a fixed-seed `test_fraction` of the distinct items (at least one)."""
  names = np.unique(items)
  n_test = max(1, int(round(test_fraction * len(names))))
  return np.sort(np.random.default_rng(seed).permutation(names)[:n_test])


def _padded(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  n = len(x)
  size = max(64, 1 << int(np.ceil(np.log2(max(n, 1)))))
  w = np.zeros(size, np.float32)
  w[:n] = 1.0
  xp = np.zeros((size, x.shape[1]), np.float32)
  xp[:n] = x
  yp = np.zeros(size, y.dtype)
  yp[:n] = y
  return xp, yp, w


def probe_cell(x: np.ndarray, y: np.ndarray, items: np.ndarray, kind: str, test_items: np.ndarray, *,
               n_classes: int = 2, l2: float = 1.0, max_train_rows: int = 20000, n_boot: int = 200,
               seed: int = 0) -> dict:
  """x [N, D] features, y [N] targets (float for regression, class indices otherwise), items [N] the item of
  each row -> {"metric", "value", "ci" [lo, hi], "chance", "train_value", "n_train", "n_test", "n_test_items",
  "skipped"} (skipped: why no probe was fitted, e.g. one class among the training rows; value NaN then)."""
  if kind not in KINDS:
    raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}.")
  test = np.isin(items, test_items)
  train_idx, test_idx = np.flatnonzero(~test), np.flatnonzero(test)
  metric = METRICS[kind]
  out = {"metric": metric, "value": float("nan"), "ci": [float("nan"), float("nan")], "chance": float("nan"),
         "train_value": float("nan"), "n_train": int(len(train_idx)), "n_test": int(len(test_idx)),
         "n_test_items": int(len(np.unique(items[test_idx]))), "skipped": None}
  if len(train_idx) < 2 or len(test_idx) < 1:
    out["skipped"] = "too few rows"
    return out
  if len(train_idx) > max_train_rows:
    train_idx = np.sort(np.random.default_rng(seed).choice(train_idx, max_train_rows, replace=False))
  y_train, y_test = y[train_idx], y[test_idx]
  if kind != "regression" and len(np.unique(y_train)) < 2:
    out["skipped"] = "one class among the training rows"
    return out
  if kind == "regression" and np.ptp(y_train) == 0:
    out["skipped"] = "constant target among the training rows"
    return out
  scaler = probes.Standardizer.fit(x[train_idx])
  xs_train, xs_test = scaler(x[train_idx]), scaler(x[test_idx])
  xp, yp, w = _padded(xs_train, y_train)
  test_items_of_rows = items[test_idx]
  if kind == "regression":
    beta, b = probes.fit_ridge(xp, yp.astype(np.float32), l2, w)
    predict_test, predict_train = xs_test @ beta + b, xs_train @ beta + b
    value = lambda rows: probes.r2(y_test[rows], predict_test[rows])
    out["train_value"] = probes.r2(y_train, predict_train)
    out["chance"] = 0.0
  else:
    fit = probes.fit_logistic(xp, yp.astype(np.int64), n_classes, l2, w)
    out["iterations"], out["grad_max"] = fit.iterations, fit.grad_max
    if kind == "binary":
      score_test = fit.scores(xs_test)[:, 0]
      value = lambda rows: probes.auc(y_test[rows], score_test[rows])
      out["train_value"] = probes.auc(y_train, fit.scores(xs_train)[:, 0])
      out["chance"] = 0.5
      out["accuracy"] = probes.accuracy(y_test, (score_test > 0).astype(np.int64))
    else:
      predicted = fit.predict(xs_test)
      value = lambda rows: probes.accuracy(y_test[rows], predicted[rows])
      out["train_value"] = probes.accuracy(y_train, fit.predict(xs_train))
      majority = np.bincount(y_train.astype(np.int64)).argmax()
      out["chance"] = probes.accuracy(y_test, np.full(len(y_test), majority))
  out["value"] = value(np.arange(len(test_idx)))
  out["ci"] = list(probes.bootstrap_ci(value, test_items_of_rows, n_boot=n_boot, seed=seed))
  return out


def first_reading_bin(cells: list[dict]) -> int | None:
  """The first step bin from which on every bin's interval lies above chance (its low end > chance; a cell
  without a probe breaks the run), or None. Asking every later bin too keeps one lucky bin among many from
  counting."""
  first = None
  for cell in sorted(cells, key=lambda c: c["step_bin"]):
    above = np.isfinite(cell["ci"][0]) and cell["ci"][0] > cell["chance"]
    first = (cell["step_bin"] if first is None else first) if above else None
  return first
