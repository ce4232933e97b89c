"""LLaDA's and Dream's block modes are families of their own: the options choose the family, and the exact
families carry none of the block modes' phases, early finish or cache."""

import numpy as np
import pytest

from dlm_jax.config import preset
from dlm_jax.sampling import dream, llada

PROMPT = np.array([[3, 4, 5, 6]], np.int32)


@pytest.mark.parametrize("module,config,exact,block", [
    (llada, "tiny-llada", llada.LLaDAOptions(gen_length=8, steps=4, block_length=4),
     llada.LLaDAOptions(gen_length=8, steps=4, block_length=4, threshold=0.9)),
    (dream, "tiny-dream", dream.DreamOptions(gen_length=8, steps=4),
     dream.DreamOptions(gen_length=8, steps=4, block_length=4, threshold=0.9)),
])
def test_options_choose_the_exact_or_the_block_family(module, config, exact, block):
  exact_family = module._family(preset(config), exact, PROMPT)  # pylint: disable=protected-access
  block_family = module._family(preset(config), block, PROMPT)  # pylint: disable=protected-access
  assert type(block_family).__name__.endswith("BlockwiseFamily") and block_family.can_finish_early
  assert isinstance(block_family, type(exact_family)) and not isinstance(exact_family, type(block_family))
  assert not exact_family.can_finish_early and len(exact_family.phases(None)) == 1
  assert block_family.name == f"{exact_family.name}_blockwise"
