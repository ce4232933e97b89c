"""The one logit-shift rule (`dlm_jax.config.logit_shift`): it reads outputs as Dream's code does (written out
here from reference/models.md §3.6), and the training objective, which once put zeros in the never-scored row
0, gives the same loss, metrics and gradient bit for bit whatever that row holds."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlm_jax import training
from dlm_jax.config import logit_shift, preset
from dlm_jax.model import init_params

B, L = 2, 8


def _dream_shift(logits):
  """Dream's `logits'[:, 0] = logits[:, 0]`, `logits'[:, i] = logits[:, i − 1]` over the whole sequence."""
  return np.concatenate([logits[:, :1], logits[:, :-1]], axis=1)


@pytest.mark.parametrize("shift", [0, 1])
@pytest.mark.parametrize("start", [0, 1, 3])
def test_target_logits_equal_dream_code_on_any_target_span(shift, start):
  outputs = np.random.RandomState(0).randn(B, L, 5).astype(np.float32)
  expected = (_dream_shift(outputs) if shift else outputs)[:, start:]
  a, b = logit_shift.output_window(start, L, shift)
  np.testing.assert_array_equal(logit_shift.target_logits(jnp.asarray(outputs[:, a:b]), start, shift), expected)


def test_output_window_reads_the_previous_position_when_shifted():
  assert logit_shift.output_window(3, 10, 0) == (3, 10)
  assert logit_shift.output_window(3, 10, 1) == (2, 9)
  assert logit_shift.output_window(0, 10, 1) == (0, 9)


@pytest.mark.parametrize("kind", ["pretrain", "sft"])
def test_training_never_reads_row_zero_of_a_shifted_model(kind, monkeypatch):
  config = preset("tiny-dream")
  params = init_params(config, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (B, L), 3, 250)
  prompt = jnp.arange(L)[None, :] < jnp.array([[2], [3]])
  batch = {"tokens": tokens, "prompt_mask": prompt, "target_mask": ~prompt}

  def loss_and_grad():
    fn = lambda p: training.loss_fn(p, batch, jax.random.key(2), config=config, objective=training.Objective(kind))
    return jax.value_and_grad(fn, has_aux=True)(params)

  shared = loss_and_grad()
  rule = logit_shift.target_logits
  monkeypatch.setattr(logit_shift, "target_logits",
                      lambda outputs, start, shift: rule(outputs, start, shift).at[:, 0].set(0.0))
  zeros = loss_and_grad()
  for got, want in zip(jax.tree.leaves(shared), jax.tree.leaves(zeros), strict=True):
    assert np.asarray(got).tobytes() == np.asarray(want).tobytes()
