"""`torch_cpu_top_k` against `torch.topk` itself on tie-heavy rows through torch's `std::partial_sort` path
(k * 64 <= n); the `std::nth_element` path, where torch's ties differ from lowest-first, is compared with
torch in tests/test_policy_sparse_dllm.py (Sparse-dLLM's default tie rule)."""

import jax
import numpy as np
import torch

from dlm_jax.policy.torch_topk import torch_cpu_top_k


def test_partial_sort_path_equals_torch_on_ties():
  rows = np.random.default_rng(0).integers(0, 3, (8, 130)).astype(np.float32)
  chosen = np.asarray(jax.jit(lambda rows: torch_cpu_top_k(rows, 2))(rows))
  for row, picked in zip(rows, chosen):
    np.testing.assert_array_equal(np.flatnonzero(picked), np.sort(torch.topk(torch.tensor(row), 2).indices.numpy()))
