"""The one Transformer behind every supported model (Flax NNX modules) and its pure entry point.

A walk from the top: `forward` (forward.py) checks its inputs, rebuilds the `Transformer`
(transformer.py) from the params tree (params.py) and runs it: embedding, the stacked `Block`s
(block.py) under `lax.scan`, each an attention layer (attention_layer.py: projections, QK norm,
RoPE from rope.py, the KV cache of cache.py, then the attention core and its biases in attention.py)
and a dense (primitives.py) or mixture-of-experts (moe.py) feed-forward; then the final norm and LM head.

What other packages use is re-exported here: `from dlm_jax import model; model.forward(...)`.
"""

from dlm_jax.model.attention_layer import Attention
from dlm_jax.model.block import Block, SelfConditioning
from dlm_jax.model.cache import KVCache
from dlm_jax.model.forward import DecoderCall, forward, lm_head
from dlm_jax.model.forward_inputs import CallInstruments, Compute, Readout
from dlm_jax.model.primitives import RMSNorm, SwiGLU, rms_normalize
from dlm_jax.model.moe import MoE, Experts, Router, route
from dlm_jax.model.params import (PARAM_AXES, Params, abstract_params, active_param_count, flatten_params,
                                  init_params, param_count, unflatten_params)
from dlm_jax.model.transformer import Transformer

__all__ = ["Attention", "Block", "CallInstruments", "Compute", "DecoderCall", "Experts", "KVCache", "MoE",
           "PARAM_AXES", "Params", "RMSNorm", "Readout", "Router", "SelfConditioning", "SwiGLU", "Transformer",
           "abstract_params", "active_param_count", "flatten_params", "forward", "init_params", "lm_head",
           "param_count", "rms_normalize", "route", "unflatten_params"]
