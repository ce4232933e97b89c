"""Device meshes and logical-axis sharding rules for parameters and activations.

The mesh has three axes: `data` (batch replicas), `fsdp` (batch and parameter shards, gathered per layer
by XLA) and `tensor` (heads, MLP and vocabulary shards). Every parameter dimension carries a logical name,
declared once next to the parameters (`dlm_jax.model.PARAM_AXES`: `vocab`, `embed`, `heads`, `kv_heads`,
`mlp`, `expert`, `shared_mlp`, `layers`, or None = replicated), and a rule set maps logical names to mesh axes. Meshes use
`AxisType.Auto`: shardings are placed on parameters and inputs and XLA's SPMD partitioner propagates them
through the model (see BUILD.md for why not Explicit).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from dlm_jax.config import ModelConfig
from dlm_jax.model import PARAM_AXES

MESH_AXES = ("data", "fsdp", "tensor")

@dataclasses.dataclass(frozen=True)
class ShardingRules:
  """Logical axis name -> mesh axes (a tuple; empty = replicated).

  The default shards the batch over (data, fsdp), parameter rows over fsdp and heads / kv heads / MLP /
  vocabulary over tensor: FSDP plus Megatron-style tensor parallelism. Routed experts are split whole over
  tensor (`expert`: expert parallelism; an expert's hidden axis stays unsplit) and the shared experts'
  hidden axis like the dense MLP's (`shared_mlp`).
  """

  batch: tuple[str, ...] = ("data", "fsdp")
  vocab: tuple[str, ...] = ("tensor",)
  embed: tuple[str, ...] = ("fsdp",)
  heads: tuple[str, ...] = ("tensor",)
  kv_heads: tuple[str, ...] = ("tensor",)
  mlp: tuple[str, ...] = ("tensor",)
  expert: tuple[str, ...] = ("tensor",)
  shared_mlp: tuple[str, ...] = ("tensor",)
  layers: tuple[str, ...] = ()

  def spec(self, logical_axes: Sequence[str | None]) -> PartitionSpec:
    """PartitionSpec for a tensor with the given logical axes."""
    entries = []
    for name in logical_axes:
      axes = () if name is None else getattr(self, name)
      entries.append(None if not axes else (axes[0] if len(axes) == 1 else tuple(axes)))
    return PartitionSpec(*entries)


def parse_mesh(text: str) -> dict[str, int]:
  """Parses "data:2,fsdp:2,tensor:2" (axes may be omitted; they default to 1)."""
  sizes = {axis: 1 for axis in MESH_AXES}
  if not text:
    return sizes
  for part in text.split(","):
    name, _, value = part.partition(":")
    name = name.strip()
    if name not in sizes or not value.strip().isdigit() or int(value) < 1:
      raise ValueError(f"Bad mesh entry {part!r} in {text!r}: expected AXIS:SIZE with AXIS in {MESH_AXES} "
                       "and SIZE a positive integer, e.g. 'data:2,fsdp:2,tensor:2'.")
    sizes[name] = int(value)
  return sizes


def make_mesh(data: int = 1, fsdp: int = 1, tensor: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A (data, fsdp, tensor) mesh with Auto axis types over `devices` (default: all devices)."""
  devices = list(jax.devices() if devices is None else devices)
  needed = data * fsdp * tensor
  if needed != len(devices):
    raise ValueError(f"Mesh data={data} x fsdp={fsdp} x tensor={tensor} needs {needed} devices; "
                     f"{len(devices)} are available. Change the mesh sizes so their product is {len(devices)}.")
  grid = np.asarray(devices).reshape(data, fsdp, tensor)
  return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * 3)


def param_logical_axes(params: Mapping[str, Any]) -> dict[str, Any]:
  """Tree of logical-axis tuples with the structure of `params` (a nested dict)."""

  def walk(node, prefix):
    if isinstance(node, Mapping):
      return {key: walk(value, f"{prefix}{key}.") for key, value in node.items()}
    name = prefix[:-1]
    if name not in PARAM_AXES:
      raise ValueError(f"No sharding rule for parameter {name!r}; known: {sorted(PARAM_AXES)}.")
    return PARAM_AXES[name]

  return walk(params, "")


def check_rules(config: ModelConfig, mesh: Mesh, rules: ShardingRules = ShardingRules()) -> None:
  """Raises if the mesh cannot shard this model under `rules` (sizes must divide, heads stay whole)."""
  shape = dict(mesh.shape)

  def size(logical: str) -> int:
    return math.prod(shape[axis] for axis in getattr(rules, logical))

  whole_units = {
      "heads": (config.n_heads, "query heads"),
      "kv_heads": (config.n_kv_heads, "kv heads"),
      "mlp": (config.mlp_hidden, "MLP width"),
      "expert": (config.n_experts, "routed experts"),
      "shared_mlp": (config.n_shared_experts * config.shared_expert_hidden, "shared-expert width"),
      "vocab": (config.vocab_size, "vocabulary rows"),
      "embed": (config.d_model, "model width"),
      "layers": (config.n_layers, "layers"),
  }
  for logical, (count, what) in whole_units.items():
    if count % size(logical):
      raise ValueError(
          f"{config.name}: the {what} ({count}) cannot be split over mesh axes {getattr(rules, logical)} of total "
          f"size {size(logical)} (logical axis {logical!r}); pick mesh sizes that divide {count}.")


def param_shardings(config: ModelConfig, mesh: Mesh, params: Mapping[str, Any],
                    rules: ShardingRules = ShardingRules()) -> dict[str, Any]:
  """NamedSharding per parameter, same tree as `params` (arrays or ShapeDtypeStructs)."""
  check_rules(config, mesh, rules)
  axes = param_logical_axes(params)
  return jax.tree.map(lambda logical: NamedSharding(mesh, rules.spec(logical)), axes,
                      is_leaf=lambda node: isinstance(node, tuple))


def batch_sharding(mesh: Mesh, ndim: int, rules: ShardingRules = ShardingRules()) -> NamedSharding:
  """Sharding of a [B, ...] activation or token array: batch over the batch axes, the rest replicated."""
  return NamedSharding(mesh, rules.spec(("batch",) + (None,) * (ndim - 1)))


def check_batch(batch_size: int, mesh: Mesh, rules: ShardingRules = ShardingRules()) -> None:
  """Raises unless the batch divides evenly over the batch mesh axes."""
  shards = math.prod(dict(mesh.shape)[axis] for axis in rules.batch)
  if batch_size % shards:
    raise ValueError(f"Batch size {batch_size} must be a multiple of the {shards} batch shards "
                     f"(mesh axes {rules.batch}); pad the batch or change the mesh.")


def bytes_per_device(params: Mapping[str, Any], shardings: Mapping[str, Any]) -> int:
  """Largest number of parameter bytes any one device holds under `shardings` (from abstract shapes)."""
  totals: dict[int, int] = {}
  for leaf, sharding in zip(jax.tree.leaves(params), jax.tree.leaves(shardings)):
    itemsize = np.dtype(leaf.dtype).itemsize
    for device, index in sharding.devices_indices_map(tuple(leaf.shape)).items():
      elements = math.prod(len(range(*s.indices(dim))) for s, dim in zip(index, leaf.shape))
      totals[device.id] = totals.get(device.id, 0) + elements * itemsize
  return max(totals.values())


def put_host(tree: Any, shardings: Any) -> Any:
  """Global arrays from host values that every process holds in full; each device receives only its slice.

  tree: a pytree of numpy-convertible arrays; shardings: one `jax.sharding.Sharding` for every leaf, or a
  tree of them with the structure of `tree`. Works in multi-process runs (no device ever sees a slice
  that another process would have to send), unlike `jax.device_put` of a host array onto non-addressable
  devices.
  """

  def put(leaf, sharding):
    host = np.asarray(leaf)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

  if isinstance(shardings, jax.sharding.Sharding):
    return jax.tree.map(lambda leaf: put(leaf, shardings), tree)
  return jax.tree.map(put, tree, shardings)


def put_rows(tree: Any, mesh: Mesh, rules: ShardingRules = ShardingRules()) -> Any:
  """`put_host` of [B, ...] host arrays with the batch axis sharded over the batch mesh axes (B must divide)."""
  for leaf in jax.tree.leaves(tree):
    check_batch(np.shape(leaf)[0], mesh, rules)
  return jax.tree.map(lambda leaf: put_host(leaf, batch_sharding(mesh, np.ndim(leaf), rules)), tree)


def replicated(mesh: Mesh) -> NamedSharding:
  """The fully replicated sharding on `mesh`."""
  return NamedSharding(mesh, PartitionSpec())
