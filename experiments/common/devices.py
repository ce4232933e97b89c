"""What a binary runs on: XLA CPU options, distributed start-up, virtual CPU devices, matmul precision, the
device mesh, and placing host arrays on it (`RuntimeSettings`; its flags are `runtime_flags`, kept apart so that
importing the settings defines no flag — a module that imports them and a binary with flags of the same names,
e.g. `experiments.forward`'s --matmul_precision, can live in one process, as the test suite needs).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from dlm_jax.runtime import distributed, sharding, xla_cpu
from dlm_jax.session import size_limits
from experiments.common.cli import UserError


@dataclasses.dataclass(frozen=True)
class RuntimeSettings:
  """Where and how a binary runs (the module docstring says what each field is). `mesh` is the --mesh text; the
  parsed sizes are `mesh_sizes`."""

  mesh: str = ""
  distributed: str = "auto"
  coordinator_address: str | None = None
  num_processes: int | None = None
  process_id: int | None = None
  cpu_devices: int = 0
  matmul_precision: str = "highest"
  xla_cpu_options: str = "auto"

  def __post_init__(self):
    if self.cpu_devices < 0:
      raise UserError(f"--cpu_devices={self.cpu_devices}: expected 0 (backend default) or a positive count")
    size_limits.check(cpu_devices=self.cpu_devices)
    if self.num_processes is not None and self.num_processes < 1:
      raise UserError(f"--num_processes={self.num_processes}: expected a positive count")
    if self.process_id is not None and self.process_id < 0:
      raise UserError(f"--process_id={self.process_id}: expected a rank >= 0")
    if self.xla_cpu_options not in xla_cpu.CHOICES:
      raise UserError(f"--xla_cpu_options={self.xla_cpu_options}: expected one of {', '.join(xla_cpu.CHOICES)}")
    self.mesh_sizes  # pylint: disable=pointless-statement  (validates --mesh now)

  @property
  def mesh_sizes(self) -> dict[str, int] | None:
    """{axis: size} of --mesh, or None without a mesh."""
    if not self.mesh:
      return None
    try:
      return sharding.parse_mesh(self.mesh)
    except ValueError as e:
      raise UserError(f"--mesh={self.mesh}: {e}") from None


class Runtime:
  """What a binary runs on.

  Attributes:
    mesh: a `jax.sharding.Mesh` (axes data, fsdp, tensor) or None for one device.
    primary: this process writes results (`dlm_jax.runtime.distributed.is_primary`).
    batch_shards: number of shards of the batch axis (data × fsdp; 1 without a mesh).
  """

  def __init__(self, mesh, primary: bool):
    self.mesh = mesh
    self.primary = primary
    self.batch_shards = 1 if mesh is None else int(mesh.shape["data"] * mesh.shape["fsdp"])

  def round_batch(self, batch_size: int) -> int:
    """The smallest multiple of the batch shards that is >= batch_size."""
    return int(math.ceil(max(batch_size, 1) / self.batch_shards) * self.batch_shards)


def _mesh(sizes: dict[str, int], text: str):
  """The mesh over the first data·fsdp·tensor devices (all processes' devices in a multi-process run)."""
  available = jax.devices()
  needed = math.prod(sizes.values())
  if needed > len(available):
    raise UserError(f"--mesh={text} needs {needed} devices; {len(available)} are available")
  if needed < len(available) and jax.process_count() > 1:
    raise UserError(f"--mesh={text} uses {needed} of {len(available)} devices; a multi-process run must use "
                    "every device")
  return sharding.make_mesh(**sizes, devices=available[:needed])


def init_runtime(settings: RuntimeSettings) -> Runtime:
  """Sets the XLA CPU options, starts jax.distributed (per the settings), sets devices and precision, builds
  the mesh. Must run before anything creates a JAX backend."""
  options = xla_cpu.apply(settings.xla_cpu_options)
  log = logging.info if options.flags else logging.debug  # quiet when XLA's defaults are kept
  log("XLA CPU options %s (--xla_cpu_options=%s), XLA_FLAGS=%r", options.name, options.choice, options.xla_flags)
  if settings.cpu_devices:
    jax.config.update("jax_num_cpu_devices", settings.cpu_devices)
  try:
    distributed.initialize(settings.distributed, settings.coordinator_address, settings.num_processes,
                           settings.process_id)
  except ValueError as e:  # the flag checks of `distributed.initialize`, before any connection
    raise UserError(str(e)) from None
  jax.config.update("jax_default_matmul_precision", settings.matmul_precision)
  mesh = None
  if settings.mesh_sizes is not None:
    mesh = _mesh(settings.mesh_sizes, settings.mesh)
    logging.info("mesh %s over %d devices in %d process(es)", dict(mesh.shape), mesh.size, jax.process_count())
  return Runtime(mesh, distributed.is_primary())


def place_batch(array: Any, runtime: Runtime) -> jax.Array:
  """A host [B, ...] array as a global array, batch axis sharded over (data, fsdp) on the mesh (every
  process passes the same full batch; each device reads its rows)."""
  if runtime.mesh is None:
    return jnp.asarray(np.asarray(array))
  return sharding.put_rows(array, runtime.mesh)


def replicate(tree: Any, runtime: Runtime) -> Any:
  """Places every array leaf of `tree` replicated on the mesh (unchanged without a mesh)."""
  if runtime.mesh is None:
    return tree
  return sharding.put_host(tree, sharding.replicated(runtime.mesh))
