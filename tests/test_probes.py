"""Linear probes (`dlm_jax.analysis.probes`, `probe_cells`): ridge against its normal equations and scikit-learn,
logistic regression against scikit-learn's optimum, AUC / R² against direct NumPy counts, padding rows that
change nothing, the item bootstrap and the one-class cell."""

import numpy as np
import pytest

from dlm_jax.analysis import probe_cells, probes


def _data(n=240, d=12, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((n, d)).astype(np.float32)
  w = rng.standard_normal(d)
  return x, w, rng


def test_ridge_equals_the_normal_equations_and_sklearn():
  x, w, rng = _data()
  y = (x @ w + 0.3 * rng.standard_normal(len(x)) + 2.0).astype(np.float32)
  beta, b = probes.fit_ridge(x, y, 3.0)
  x64, y64 = x.astype(np.float64), y.astype(np.float64)
  xc, yc = x64 - x64.mean(0), y64 - y64.mean()
  ref = np.linalg.solve(xc.T @ xc + 3.0 * np.eye(x.shape[1]), xc.T @ yc)
  np.testing.assert_allclose(beta, ref, atol=1e-5)
  assert abs(b - (y64.mean() - x64.mean(0) @ ref)) < 1e-5
  sklearn = pytest.importorskip("sklearn.linear_model")
  fit = sklearn.Ridge(alpha=3.0).fit(x64, y64)
  np.testing.assert_allclose(beta, fit.coef_, atol=1e-5)


def test_logistic_reaches_sklearns_optimum_through_padding_rows():
  """Every logistic fit here has the padded shape [128, 12] (one compiled program per class count): 100 rows
  and 28 padding rows of weight 0, against scikit-learn on the 100 rows alone."""
  sklearn = pytest.importorskip("sklearn.linear_model")
  x, w, rng = _data(n=100)
  y = (x @ w + 0.5 * rng.standard_normal(len(x)) > 0).astype(np.int64)
  xp, yp, weights = probe_cells._padded(x, y)  # pylint: disable=protected-access
  assert xp.shape == (128, 12) and weights.sum() == 100 and not weights[100:].any()
  fit = probes.fit_logistic(xp, yp, 2, 2.0, weights, tol=1e-5)
  ref = sklearn.LogisticRegression(C=0.5, tol=1e-10, max_iter=10000).fit(x, y)
  assert fit.grad_max < 1e-4
  np.testing.assert_allclose(fit.coef[:, 0], ref.coef_[0], atol=1e-3)  # float32 optimum, coefficients of size ~1
  np.testing.assert_allclose(fit.intercept, ref.intercept_, atol=1e-3)
  y3 = np.argmax(x[:, :3] + 0.3 * rng.standard_normal((len(x), 3)), 1)
  y3p = probe_cells._padded(x, y3)[1]  # pylint: disable=protected-access
  fit3 = probes.fit_logistic(xp, y3p, 3, 1.0, weights, tol=1e-5)
  ref3 = sklearn.LogisticRegression(C=1.0, tol=1e-10, max_iter=10000).fit(x, y3)
  p = np.exp(fit3.scores(x) - fit3.scores(x).max(1, keepdims=True))
  np.testing.assert_allclose(p / p.sum(1, keepdims=True), ref3.predict_proba(x), atol=5e-4)  # float32 optimum
  ridge_plain = probes.fit_ridge(x, y.astype(np.float32), 1.0)
  ridge_padded = probes.fit_ridge(xp, yp.astype(np.float32), 1.0, weights)
  np.testing.assert_allclose(ridge_plain[0], ridge_padded[0], atol=1e-5)


def test_auc_and_r2_against_direct_counts():
  rng = np.random.default_rng(1)
  y = rng.integers(0, 2, 200)
  score = np.round(rng.standard_normal(200) + y, 1)  # rounded: ties
  pos, neg = score[y == 1], score[y == 0]
  pairs = (pos[:, None] > neg[None]).sum() + 0.5 * (pos[:, None] == neg[None]).sum()
  assert abs(probes.auc(y, score) - pairs / (len(pos) * len(neg))) < 1e-12
  assert np.isnan(probes.auc(np.ones(5), np.arange(5)))
  t, p = rng.standard_normal(50), rng.standard_normal(50)
  assert abs(probes.r2(t, p) - (1 - np.sum((t - p) ** 2) / np.sum((t - t.mean()) ** 2))) < 1e-12


def test_bootstrap_resamples_items_and_is_seeded():
  rng = np.random.default_rng(2)
  groups = np.repeat(np.arange(20), 5)
  values = rng.standard_normal(100) + groups * 0.1
  mean = lambda rows: float(values[rows].mean())
  lo, hi = probes.bootstrap_ci(mean, groups, n_boot=300, seed=4)
  assert lo < values.mean() < hi and (lo, hi) == probes.bootstrap_ci(mean, groups, n_boot=300, seed=4)
  # Each resample draws whole items: the rows of a drawn item always come together.
  seen = []
  probes.bootstrap_ci(lambda rows: seen.append(np.asarray(rows)) or 0.0, groups, n_boot=5)
  for rows in seen:
    counts = np.bincount(rows, minlength=100).reshape(20, 5)  # draws of each row, by item
    assert len(rows) == 100 and np.all(counts == counts[:, :1])


def test_cells_split_by_item_and_skip_one_class():
  x, w, _ = _data(n=128)
  items = np.repeat(np.arange(16), 8)
  test_items = probe_cells.split_items(items, 0.25, 0)
  assert len(test_items) == 4 and np.array_equal(test_items, probe_cells.split_items(items, 0.25, 0))
  y = (x @ w > 0).astype(np.int64)
  cell = probe_cells.probe_cell(x, y, items, "binary", test_items, n_boot=50)  # 96 training rows: [128, 12]
  assert cell["metric"] == "auc" and cell["value"] > 0.9 and cell["ci"][0] <= cell["value"] <= cell["ci"][1]
  assert cell["n_train"] == 96 and cell["n_test"] == 32 and cell["n_test_items"] == 4 and cell["skipped"] is None
  one = probe_cells.probe_cell(x, np.zeros(128, np.int64), items, "binary", test_items)
  assert one["skipped"] == "one class among the training rows" and np.isnan(one["value"])
  reg = probe_cells.probe_cell(x, (x @ w).astype(np.float32), items, "regression", test_items, n_boot=20)
  assert reg["metric"] == "r2" and reg["value"] > 0.99


def test_first_reading_bin_needs_every_later_bin_above_chance():
  cell = lambda b, low: {"step_bin": b, "ci": [low, 1.0], "chance": 0.5}
  assert probe_cells.first_reading_bin([cell(0, 0.4), cell(1, 0.6), cell(2, 0.45), cell(3, 0.55), cell(4, 0.7)]) == 3
  assert probe_cells.first_reading_bin([cell(1, 0.6), cell(0, 0.6)]) == 0
  assert probe_cells.first_reading_bin([cell(0, 0.6), cell(1, float("nan"))]) is None
  assert probe_cells.first_reading_bin([cell(0, 0.5)]) is None
