"""The parameter tree of the one Transformer: logical axes of every tensor, random and abstract
parameters, parameter counts, and the flat tensor names of converted checkpoints.

Parameter tree: `PARAM_AXES` lists every tensor by flat name (the names joined with "." are the
tensor names of converted checkpoints) with its logical axes, which `dlm_jax.runtime.sharding` maps to mesh axes.
Logical axis sizes: layers (the stack's length), vocab V, embed D, heads N·H, kv_heads K·H, mlp F,
expert E, shared_mlp n_shared_experts·shared_expert_hidden. The q/k/v biases exist only when `qkv_bias`,
`attn.{q,k}_norm.weight` [H] only when `qk_norm`; `lm_head.kernel` is absent when `tied_embeddings`. MoE
layers replace `mlp.{gate,up,down}.kernel` by `mlp.router.kernel` [D, E] (+ `mlp.router.score_bias` [E]
for the "sigmoid_group" router), the stacked experts `mlp.experts.{gate,up}.kernel` [E, D, F_e] and
`mlp.experts.down.kernel` [E, F_e, D], and, with shared experts, `mlp.shared.{gate,up,down}.kernel`.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from dlm_jax.config import ModelConfig
from dlm_jax.model.transformer import Transformer

Params = dict[str, Any]

_DENSE_BLOCK_AXES: dict[str, tuple[str | None, ...]] = {
    "attn_norm.weight": ("layers", None),
    "attn.q.kernel": ("layers", "embed", "heads"),
    "attn.q.bias": ("layers", "heads"),
    "attn.k.kernel": ("layers", "embed", "kv_heads"),
    "attn.k.bias": ("layers", "kv_heads"),
    "attn.v.kernel": ("layers", "embed", "kv_heads"),
    "attn.v.bias": ("layers", "kv_heads"),
    "attn.o.kernel": ("layers", "heads", "embed"),
    "attn.q_norm.weight": ("layers", None),
    "attn.k_norm.weight": ("layers", None),
    "mlp_norm.weight": ("layers", None),
    "mlp.gate.kernel": ("layers", "embed", "mlp"),
    "mlp.up.kernel": ("layers", "embed", "mlp"),
    "mlp.down.kernel": ("layers", "mlp", "embed"),
    "post_attn_norm.weight": ("layers", None),
    "post_mlp_norm.weight": ("layers", None),
    "moe_norm.weight": ("layers", None),
    "post_moe_norm.weight": ("layers", None),
    "post_ffn_norm.weight": ("layers", None),
    "layer_scalar": ("layers", None),
}
_MOE_FEED_FORWARD_AXES: dict[str, tuple[str | None, ...]] = {
    "mlp.router.kernel": ("layers", "embed", None),
    "mlp.router.score_bias": ("layers", None),
    "mlp.router.scale": ("layers", None),
    "mlp.router.per_expert_scale": ("layers", None),
    "mlp.experts.gate.kernel": ("layers", "expert", "embed", None),
    "mlp.experts.up.kernel": ("layers", "expert", "embed", None),
    "mlp.experts.down.kernel": ("layers", "expert", None, "embed"),
    "mlp.shared.gate.kernel": ("layers", "embed", "shared_mlp"),
    "mlp.shared.up.kernel": ("layers", "embed", "shared_mlp"),
    "mlp.shared.down.kernel": ("layers", "shared_mlp", "embed"),
}

PARAM_AXES: dict[str, tuple[str | None, ...]] = {
    "embed.embedding": ("vocab", "embed"),
    **{f"blocks.{name}": axes for name, axes in {**_DENSE_BLOCK_AXES, **_MOE_FEED_FORWARD_AXES}.items()},
    **{f"dense_blocks.{name}": axes for name, axes in _DENSE_BLOCK_AXES.items()},
    **{f"global_blocks.{name}": axes for name, axes in _DENSE_BLOCK_AXES.items()},
    **{f"global_blocks.{name.replace('mlp.', 'moe.', 1)}": axes for name, axes in _MOE_FEED_FORWARD_AXES.items()},
    **{f"blocks.{name.replace('mlp.', 'moe.', 1)}": axes for name, axes in _MOE_FEED_FORWARD_AXES.items()},
    "self_conditioning.pre_norm.weight": (None,),
    "self_conditioning.mlp.gate.kernel": ("embed", "mlp"),
    "self_conditioning.mlp.up.kernel": ("embed", "mlp"),
    "self_conditioning.mlp.down.kernel": ("mlp", "embed"),
    "final_norm.weight": (None,),
    "lm_head.kernel": ("embed", "vocab"),
}
"""Logical axes of every parameter (flat name -> one name per dimension; None = never sharded)."""


@functools.lru_cache(maxsize=64)
def graphdef(config: ModelConfig) -> nnx.GraphDef:
  return nnx.graphdef(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))


def init_params(config: ModelConfig, key: jax.Array, dtype: Any = jnp.float32) -> Params:
  """Random parameters (nested dict of arrays; see the module docstring for the tree)."""
  return nnx.to_pure_dict(nnx.state(Transformer(config, rngs=nnx.Rngs(params=key), dtype=dtype)))


def abstract_params(config: ModelConfig, dtype: Any = jnp.bfloat16) -> Params:
  """The parameter tree as `jax.ShapeDtypeStruct` leaves, without allocating anything."""
  return jax.eval_shape(lambda: init_params(config, jax.random.key(0), dtype))


def param_count(config: ModelConfig) -> int:
  """Number of parameters of `config`, from abstract shapes."""
  return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(abstract_params(config)))


def active_param_count(config: ModelConfig) -> int:
  """Non-embedding parameters one token passes through: everything except the embedding table and the
  LM head, with the routed experts counted k/E (the k experts a token is sent to). Equals
  `param_count` minus the vocabulary matrices for a dense model."""
  total = 0
  for name, leaf in flatten_params(abstract_params(config)).items():
    if name in ("embed.embedding", "lm_head.kernel"):
      continue
    size = math.prod(leaf.shape)
    if ".mlp.experts." in name or ".moe.experts." in name:
      size = size // config.n_experts * config.experts_per_token
    total += size
  return total


def flatten_params(params: Params) -> dict[str, Any]:
  """{"blocks.attn.q.kernel": array, ...}: the tensor names used by converted checkpoints."""
  flat = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    flat[".".join(str(p.key) for p in path)] = leaf
  return flat


def unflatten_params(flat: dict[str, Any]) -> Params:
  """Inverse of `flatten_params`."""
  params: Params = {}
  for name, leaf in flat.items():
    node = params
    *parents, last = name.split(".")
    for part in parents:
      node = node.setdefault(part, {})
    node[last] = leaf
  return params
