"""Runtime flags and helpers of every binary: distributed start-up, virtual CPU devices, matmul precision,
the device mesh, and placing host arrays on it.

Flags:
  --mesh                 e.g. "data:2,fsdp:2,tensor:2" (default: no mesh, one device)
  --distributed          auto|on|off: `dlm_jax.distributed.initialize` before anything touches devices
  --coordinator_address  host:port of process 0 (else JAX_COORDINATOR_ADDRESS or cluster auto-detection)
  --num_processes        processes in the run (with --coordinator_address, outside SLURM/TPU/MPI)
  --process_id           this process's rank (same)
  --cpu_devices          N > 0 asks the CPU backend for N virtual devices (to try meshes on a CPU)
  --matmul_precision     jax_default_matmul_precision
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags, logging

from dlm_jax import distributed, sharding

FLAGS = flags.FLAGS
flags.DEFINE_string("mesh", "", "Device mesh, e.g. 'data:2,fsdp:2,tensor:2' (empty: single device).")
flags.DEFINE_enum("distributed", "auto", ["auto", "on", "off"], "jax.distributed start-up (multi-host runs).")
flags.DEFINE_string("coordinator_address", None, "host:port of process 0 for jax.distributed (multi-process runs).")
flags.DEFINE_integer("num_processes", None, "Number of processes of a multi-process run.")
flags.DEFINE_integer("process_id", None, "Rank of this process in a multi-process run.")
flags.DEFINE_integer("cpu_devices", 0, "Virtual CPU devices (0 = backend default); for trying --mesh on a CPU.")
flags.DEFINE_enum("matmul_precision", "highest", ["default", "high", "highest"], "jax_default_matmul_precision.")


class Runtime:
  """What a binary runs on.

  Attributes:
    mesh: a `jax.sharding.Mesh` (axes data, fsdp, tensor) or None for one device.
    primary: this process writes results (`dlm_jax.distributed.is_primary`).
    batch_shards: number of shards of the batch axis (data × fsdp; 1 without a mesh).
  """

  def __init__(self, mesh, primary: bool):
    self.mesh = mesh
    self.primary = primary
    self.batch_shards = 1 if mesh is None else int(mesh.shape["data"] * mesh.shape["fsdp"])

  def round_batch(self, batch_size: int) -> int:
    """The smallest multiple of the batch shards that is >= batch_size."""
    return int(math.ceil(max(batch_size, 1) / self.batch_shards) * self.batch_shards)


def init_runtime() -> Runtime:
  """Starts jax.distributed (per the flags), sets devices and precision, builds the --mesh."""
  if FLAGS.cpu_devices:
    jax.config.update("jax_num_cpu_devices", FLAGS.cpu_devices)
  distributed.initialize(FLAGS.distributed, FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
  jax.config.update("jax_default_matmul_precision", FLAGS.matmul_precision)
  mesh = None
  if FLAGS.mesh:
    mesh = sharding.make_mesh(**sharding.parse_mesh(FLAGS.mesh))
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
