"""Issue 35's narrow seams, kept: no function of the model call path takes more than 8 parameters (counted with
`inspect.signature`, self and a `**old_keywords` included), from the public entry points down to the attention
cores. A new keyword belongs in one of the structs (`CallInstruments`, `Readout`, `Compute`, `RunSetup`,
`Visibility`, `AttentionComputation`, ...), not in the signature."""

import inspect

import pytest

from dlm_jax.model.attention import attention
from dlm_jax.model.attention_layer import Attention
from dlm_jax.model.block_sparse_attention import block_sparse_attention
from dlm_jax.model.forward import forward
from dlm_jax.model.block import Block
from dlm_jax.model.transformer import Transformer
from dlm_jax.sampling import autoregressive, block_diffusion, diffusion_gemma, driver, dream, llada
from dlm_jax.sampling.model_call import ModelCaller
from dlm_jax.sampling.policy_call import policy_forward
from dlm_jax.sampling.reuse_call import reuse_forward
from dlm_jax.sampling.row_by_row import forward_rows

CALL_PATH = {
    "forward": forward, "attention": attention, "block_sparse_attention": block_sparse_attention,
    "run_family": driver.run_family, "llada.generate": llada.generate, "dream.diffusion_generate":
    dream.diffusion_generate, "autoregressive.generate": autoregressive.generate,
    "block_diffusion.generate": block_diffusion.generate, "diffusion_gemma.generate": diffusion_gemma.generate,
    "ModelCaller.__call__": ModelCaller.__call__, "Transformer.__call__": Transformer.__call__,
    "Block.__call__": Block.__call__, "Attention.__call__": Attention.__call__, "policy_forward": policy_forward,
    "reuse_forward": reuse_forward, "forward_rows": forward_rows}


@pytest.mark.parametrize("name", sorted(CALL_PATH))
def test_at_most_eight_parameters(name):
  parameters = list(inspect.signature(CALL_PATH[name]).parameters)
  assert len(parameters) <= 8, f"{name} takes {len(parameters)} parameters: {parameters}"
