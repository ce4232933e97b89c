"""Schedules: torch.linspace bit for bit, LLaDA transfer counts, Dream per-step counts (against torch)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dlm_jax.sampling import schedules

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.mark.parametrize("eps", [1e-3, 1e-2, 0.0, 1e-5, 0.25, 0.123456789])
def test_torch_linspace_f32_is_bit_exact(eps):
  for n in list(range(1, 260)) + [511, 512, 513, 1024, 1025, 2049]:
    expected = torch.linspace(1, eps, n, dtype=torch.float32).numpy()
    got = schedules.torch_linspace_f32(1.0, eps, n)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32), err_msg=f"n={n}")


def test_torch_linspace_other_endpoints():
  for start, end in [(0.0, 1.0), (3.0, 17.5), (5.0, 5.0), (-2.5, 7.25)]:
    for n in (2, 3, 7, 16, 33, 100):
      expected = torch.linspace(start, end, n, dtype=torch.float32).numpy()
      np.testing.assert_array_equal(schedules.torch_linspace_f32(start, end, n), expected)


def test_jnp_linspace_differs_somewhere():
  """Why the exact port exists: jnp.linspace is not torch.linspace for some n."""
  for n in range(2, 300):
    if not np.array_equal(np.asarray(jnp.linspace(1.0, 1e-3, n, dtype=jnp.float32)),
                          torch.linspace(1, 1e-3, n).numpy()):
      return
  pytest.fail("jnp.linspace matched torch.linspace for every n < 300")


def _official_num_transfer_tokens(mask_index: torch.Tensor, steps: int) -> torch.Tensor:
  """LLaDA's get_num_transfer_tokens as described in models.md §2.8 (torch, for comparison)."""
  mask_num = mask_index.sum(dim=1, keepdim=True)
  base = mask_num // steps
  remainder = mask_num % steps
  counts = torch.zeros(mask_num.size(0), steps, dtype=torch.int64) + base
  for i in range(mask_num.size(0)):
    counts[i][:remainder[i]] += 1
  return counts


def test_llada_transfer_counts_match_official():
  rng = np.random.default_rng(0)
  for steps in (1, 2, 3, 5, 8, 32, 64):
    mask_index = torch.from_numpy(rng.random((6, 64)) < rng.random((6, 1)))
    expected = _official_num_transfer_tokens(mask_index, steps).numpy()
    got = np.asarray(schedules.llada_transfer_counts(jnp.asarray(mask_index.sum(1).numpy()), steps))
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(got.sum(1), mask_index.sum(1).numpy())


def _official_dream_counts(masked_total: int, batch: int, steps: int, eps: float) -> list[int]:
  """k per step computed with torch exactly as diffusion_generate does, at a constant masked count."""
  timesteps = torch.linspace(1, eps, steps + 1)
  mask_index = torch.zeros(batch, max(masked_total, 1), dtype=torch.bool).flatten()
  mask_index[:masked_total] = True
  mask_index = mask_index.reshape(batch, -1)
  counts = []
  for i in range(steps):
    t, s = timesteps[i], timesteps[i + 1]
    num_mask_token = mask_index.sum() / mask_index.shape[0]
    counts.append(int(num_mask_token * (1 - s / t)) if i < steps - 1 else int(num_mask_token))
  return counts


@pytest.mark.parametrize("steps,eps", [(512, 1e-3), (128, 1e-3), (64, 1e-2), (7, 1e-3), (1, 1e-3), (300, 0.05)])
def test_dream_step_counts_match_torch(steps, eps):
  count = jax.jit(schedules.dream_transfer_count, static_argnums=1)
  fractions = schedules.dream_transfer_fractions(steps, eps)
  for batch, masked_total in [(1, 512), (1, 128), (2, 256), (3, 300), (4, 17), (1, 1)]:
    expected = _official_dream_counts(masked_total, batch, steps, eps)
    host = schedules.dream_transfer_counts_numpy(masked_total, batch, steps, eps)
    np.testing.assert_array_equal(host, expected)
    device = [int(count(jnp.int32(masked_total), batch, fractions[i], jnp.bool_(i == steps - 1)))
              for i in range(0, steps, max(1, steps // 16))] + [
                  int(count(jnp.int32(masked_total), batch, fractions[-1], jnp.bool_(True)))]
    np.testing.assert_array_equal(device, [expected[i] for i in range(0, steps, max(1, steps // 16))] + [expected[-1]])


def test_dream_first_step_of_512_is_zero():
  """models.md §3.8: with 512 masks and 512 steps, step 0 transfers ⌊0.999⌋ = 0 tokens."""
  counts = schedules.dream_transfer_counts_numpy(512, 1, 512, 1e-3)
  assert counts[0] == 0


def test_dream_timesteps_shape_and_errors():
  ts = schedules.dream_timesteps(10, 1e-3)
  assert ts.shape == (11,) and ts[0] == 1.0 and ts[-1] == np.float32(1e-3)
  with pytest.raises(ValueError):
    schedules.dream_timesteps(0, 1e-3)
