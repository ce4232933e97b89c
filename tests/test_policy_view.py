"""The explorer's per-policy views (`experiments.reports.policy_view`) on small hand-written records: the
per-layer policies (Elastic-Cache's refresh start, dLLM-Cache's per-layer sets) and SparseD's kept key blocks.
dKV-Cache's notes (the rows each call ran). Sparse-dLLM and dKV-Cache are checked against real Traces in
tests/test_explorer.py."""

import numpy as np

from dlm_jax.policy.registry import make_policy, parse_policy
from experiments.reports import policy_view


def _row(computed, keys_read, record, n_layers=3):
  return policy_view.RowTrace(np.asarray(computed, bool), np.asarray(keys_read, np.float32), record, n_layers)


def test_elastic_cache_layers_from_the_refresh_start_recompute_every_position():
  computed = [[1, 1, 1, 1, 1], [1, 0, 1, 0, 0], [0, 0, 0, 1, 0]]
  record = {"refresh_start": np.array([0, 2, 3]), "queries": np.array([[0, 1], [0, 2], [3, 5]])}
  out = policy_view.step_view(make_policy("elastic_cache"), _row(computed, [5, 5, 5], record), [0, 1, 2])
  layers = out["policy_layers"].astype(int)  # [T, L, S]
  assert layers[0].all()  # the full call
  assert layers[1].tolist() == [[1, 0, 1, 0, 0], [1, 0, 1, 0, 0], [1, 1, 1, 1, 1]]  # layer 2 on: every position
  assert layers[2].tolist() == [[0, 0, 0, 1, 0]] * 3  # refresh start L: no layer refreshed
  assert out["policy"] == "elastic_cache" and "policy_keys" not in out
  assert out["policy_notes"].tolist() == ["full call", "every position from layer 2 on", "no layer refreshed"]


def test_dllm_cache_shows_its_per_layer_record():
  record = np.zeros((2, 3, 4), bool)
  record[0] = True
  record[1, 0] = True
  record[1, 1:, 3] = True
  out = policy_view.step_view(parse_policy("dllm_cache:transfer_ratio=0.5"), _row(np.ones((2, 4)), [4, 4], record),
                              [1])
  assert np.array_equal(out["policy_layers"], record)
  assert out["policy"] == "dllm_cache:transfer_ratio=0.5"
  assert out["policy_notes"].tolist() == ["recomputed per layer: 4 / 4 / 4", "recomputed per layer: 4 / 1 / 1"]


def test_dkv_cache_notes_say_the_rows_each_cached_call_ran():
  out = policy_view.step_view(make_policy("dkv_cache"), _row([[1, 1, 1, 1], [0, 0, 1, 1], [0, 0, 0, 1]], [4, 4, 4],
                                                             {"rows": np.array([4, 2, 1])}), [0])
  assert out["policy_notes"].tolist() == ["full call", "cached call, 2 rows ran", "cached call, 1 row ran"]
  assert "policy_keys" not in out and "policy_layers" not in out


def test_sparsed_keys_are_the_kept_blocks_of_each_head_and_of_any_head():
  s, policy = 10, make_policy("sparsed", block_size=4)  # key blocks [0, 4), [4, 8), [8, 10); 3 = none
  record = np.full((2, 1, 2, 2, 2), 3)  # [T, L, N, nQb, m]
  record[1, 0, 0] = [[0, 3], [0, 3]]
  record[1, 0, 1] = [[2, 3], [1, 3]]
  out = policy_view.step_view(policy, _row(np.ones((2, s)), [s, 5.0], record, 1), [0])
  keys = out["policy_keys"].astype(int)  # [T, L', N + 1, S]
  assert keys.shape == (2, 1, 3, s) and keys[0].all()  # a dense call reads every key
  assert keys[1, 0].tolist() == [[1, 1, 1, 1, 0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 1, 1, 1, 1, 1, 1], [1] * s]
  assert out["policy"] == "sparsed:block_size=4"
