"""Fused q/k/v and gate/up projections (benchmarks/fused_projections.py) compute the same forward pass with
fewer matmuls, on the unchanged parameters, and leave the model as it was outside the context."""

import jax
import numpy as np
import pytest

from benchmarks import fused_projections
from dlm_jax import model
from dlm_jax.config import preset


def _dots(fn, *args) -> int:
  return str(jax.make_jaxpr(fn)(*args)).count("dot_general")


@pytest.mark.parametrize("name", ["tiny-dream"])  # GQA with q/k/v biases
def test_fused_projections_match_the_separate_ones(name):
  config = preset(name)
  params = model.init_params(config, jax.random.key(0))
  tokens = np.random.default_rng(0).integers(0, config.vocab_size, size=(2, 12))
  run = lambda p, t: model.forward(p, t, config=config).logits  # noqa: E731
  separate, separate_dots = np.asarray(jax.jit(run)(params, tokens)), _dots(run, params, tokens)
  with fused_projections.fused():
    fused, fused_dots = np.asarray(jax.jit(run)(params, tokens)), _dots(run, params, tokens)
  np.testing.assert_allclose(fused, separate, rtol=2e-5, atol=2e-5)
  assert fused_dots < separate_dots
  assert _dots(run, params, tokens) == separate_dots  # restored on exit
