"""`ModelConfig.fused_projections`: q/k/v and gate/up as one matmul each compute the same forward pass with
fewer matmuls, on the unchanged parameters."""

import jax
import numpy as np
import pytest

from dlm_jax import model
from dlm_jax.config import preset


def _dots(fn, *args) -> int:
  return str(jax.make_jaxpr(fn)(*args)).count("dot_general")


@pytest.mark.parametrize("name", ["tiny-dream"])  # GQA with q/k/v biases
def test_fused_projections_match_the_separate_ones(name):
  config = preset(name)
  fused_config = config.replace(fused_projections=True)
  params = model.init_params(config, jax.random.key(0))
  tokens = np.random.default_rng(0).integers(0, config.vocab_size, size=(2, 12))
  run = lambda p, t: model.forward(p, t, config=config).logits  # noqa: E731
  run_fused = lambda p, t: model.forward(p, t, config=fused_config).logits  # noqa: E731
  separate = np.asarray(jax.jit(run)(params, tokens))
  fused = np.asarray(jax.jit(run_fused)(params, tokens))
  np.testing.assert_allclose(fused, separate, rtol=2e-5, atol=2e-5)
  # one q/k/v matmul instead of three and one gate/up matmul instead of two, in the one layer body the
  # stacked blocks scan over
  assert _dots(run, params, tokens) - _dots(run_fused, params, tokens) == 3
