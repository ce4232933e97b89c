"""`STATISTICS` is the only registry of per-call statistics (issue 35 item 4): a statistic added as one entry
reaches a sampler's `Trace` (every layer, and a layer subset), checked against the same layer's keys captured at
the `attn.hook_k` site (RoPE rotates pairs of coordinates, so a key's norm is the same before and after it)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlm_jax.config import preset
from dlm_jax.instrument.hook_spec import Capture, Hooks
from dlm_jax.instrument.stats import STATISTICS, Statistic, StatsSpec, register_statistic
from dlm_jax.model import init_params
from dlm_jax.sampling import llada

jax.config.update("jax_default_matmul_precision", "highest")

CONFIG = preset("tiny-llada")


@pytest.fixture(scope="module")
def key_norms():
  """A toy statistic, registered for this module only: the L2 norm of every key [L', B, K, S]."""
  register_statistic("key_norms", Statistic(
      None, ("L", "B", "K", "S"), lambda layer: jnp.linalg.norm(layer.keys.astype(jnp.float32), axis=-1)
      .transpose(0, 2, 1)))
  yield "key_norms"
  STATISTICS.pop("key_norms")


@pytest.mark.parametrize("layers", [None, (1,)])
def test_a_statistic_added_in_one_place_reaches_the_trace(key_norms, layers):
  params = init_params(CONFIG, jax.random.key(0))
  prompt = jax.random.randint(jax.random.key(1), (2, 5), 0, 200)
  trace = llada.generate(params, prompt, config=CONFIG, options=llada.LLaDAOptions(gen_length=4, steps=2,
                                                                                   block_length=4),
                         stats_spec=StatsSpec(extra=(key_norms,), layers=layers),
                         hooks=Hooks(captures=(Capture("attn.hook_k"),)))
  got = np.asarray(trace.stats[key_norms])  # [steps, L', B, K, S]
  chosen = range(CONFIG.n_layers) if layers is None else layers
  assert got.shape == (2, len(chosen), 2, CONFIG.n_kv_heads, 9)
  for slot, layer in enumerate(chosen):
    keys = np.asarray(trace.captures[f"blocks.{layer}.attn.hook_k"], np.float64)  # [steps, B, S, K, H]
    np.testing.assert_allclose(got[:, slot], np.linalg.norm(keys, axis=-1).transpose(0, 1, 3, 2), rtol=2e-6)


def test_unknown_or_switched_names_are_refused_in_one_line(key_norms):
  with pytest.raises(ValueError, match="StatsSpec.extra must be a tuple of registered statistics without a switch "
                                       "field \\(.*key_norms\\), got \\('value_norms',\\)"):
    StatsSpec(extra=("value_norms",))
  with pytest.raises(ValueError, match="already registered"):
    register_statistic(key_norms, STATISTICS[key_norms])
