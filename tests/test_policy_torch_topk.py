"""`torch_cpu_top_k` against `torch.topk` itself on tie-heavy rows, through both of torch's CPU paths
(`std::partial_sort` when k * 64 <= n, `std::nth_element` otherwise), and the tie rule it replaces."""

import jax
import numpy as np
import torch

from dlm_jax.policy.torch_topk import torch_cpu_top_k

CASES = ((130, 2), (12, 7))  # partial_sort path; nth_element (longer runs: tests/test_policy_sparse_dllm.py)


def test_sets_equal_torch_on_ties():
  rng = np.random.default_rng(0)
  rows = {n: rng.integers(0, 3, (6, n)).astype(np.float32) for n, _ in CASES}
  run = jax.jit(lambda rows: [torch_cpu_top_k(rows[n], k) for n, k in CASES])
  chosen = run(rows)
  differs_from_lowest_first = 0
  for (n, k), mask in zip(CASES, chosen):
    mask = np.asarray(mask)
    assert (mask.sum(-1) == k).all()
    for row, picked in zip(rows[n], mask):
      expected = np.sort(torch.topk(torch.tensor(row), k).indices.numpy())
      np.testing.assert_array_equal(np.flatnonzero(picked), expected)
      differs_from_lowest_first += not np.array_equal(expected, np.sort(np.argsort(-row, kind="stable")[:k]))
  assert differs_from_lowest_first > 0  # torch's nth_element keeps other tied entries than lowest-first
