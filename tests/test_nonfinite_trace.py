"""`Trace.first_nonfinite_step`: computed in the compiled program from every model call's logits, per row —
−1 for finite weights, the step at which a poisoned token first enters a row's canvas, 0 for NaN weights —
and the one-line message the binaries print."""

import jax
import jax.numpy as jnp
import numpy as np

from dlm_jax import model
from dlm_jax.config import preset
from dlm_jax.sampling import llada
from dlm_jax.sampling.trace import nonfinite_message

CONFIG = preset("tiny-llada")
OPTIONS = llada.LLaDAOptions(gen_length=8, steps=8, block_length=8)


def _params():
  return model.init_params(CONFIG, jax.random.key(0))


def test_a_poisoned_embedding_is_flagged_at_the_step_its_token_enters_the_canvas():
  params = _params()
  prompt = np.random.default_rng(0).integers(3, 200, size=(2, 5)).astype(np.int32)
  clean = llada.generate(params, prompt, config=CONFIG, options=OPTIONS)
  np.testing.assert_array_equal(np.asarray(clean.first_nonfinite_step), [-1, -1])
  tokens, steps = np.asarray(clean.generated)[0], np.asarray(clean.decode_step)[0]
  first = int(np.argmin(steps))
  token, step = int(tokens[first]), int(steps[first])
  assert token not in prompt[0] and all(int(steps[i]) > step for i in range(8) if tokens[i] == token and i != first)
  poisoned = jax.tree.map(lambda a: a, params)
  poisoned["embed"]["embedding"] = params["embed"]["embedding"].at[token].set(jnp.nan)
  trace = llada.generate(poisoned, prompt, config=CONFIG, options=OPTIONS)
  flags = np.asarray(trace.first_nonfinite_step)
  assert flags[0] == step + 1  # the first call that reads the committed token
  expected_other = -1 if token not in np.asarray(clean.tokens)[1] else flags[1]
  assert flags[1] == expected_other
  message = nonfinite_message(flags, ["item a", "item b"])
  assert message.startswith(f"the model's logits hold NaN or infinite values from step {step + 1} on for item a")


def test_nan_weights_are_flagged_at_step_zero():
  params = jax.tree.map(lambda a: jnp.full_like(a, jnp.nan), _params())
  trace = llada.generate(params, np.full((1, 4), 7, np.int32), config=CONFIG, options=OPTIONS)
  np.testing.assert_array_equal(np.asarray(trace.first_nonfinite_step), [0])
  assert nonfinite_message(np.array([-1, -1])) is None


def test_the_binaries_refuse_a_nonfinite_trace_in_one_line():
  from experiments.common import decoding  # pylint: disable=import-outside-toplevel
  from experiments.common.cli import UserError  # pylint: disable=import-outside-toplevel
  params = jax.tree.map(lambda a: jnp.full_like(a, jnp.nan), _params())
  trace = llada.generate(params, np.full((1, 4), 7, np.int32), config=CONFIG, options=OPTIONS)
  try:
    decoding.check_finite(trace, ["item 3"])
  except UserError as error:
    assert "\n" not in str(error) and "from step 0 on for item 3" in str(error)
  else:
    raise AssertionError("a NaN trace was accepted")
  decoding.check_finite(llada.generate(_params(), np.full((1, 4), 7, np.int32), config=CONFIG, options=OPTIONS))
