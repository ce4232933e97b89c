"""Multi-process (multi-host) start-up with `jax.distributed`, and which process writes results."""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np

_ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"


def _multi_process_cluster() -> bool:
  """A SLURM job with several tasks, a multi-host Cloud TPU slice, or an Open MPI run of several ranks."""
  env = os.environ
  return (int(env.get("SLURM_NTASKS", "1")) > 1 or "," in env.get("TPU_WORKER_HOSTNAMES", "")
          or int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1)


def initialize(mode: str = "auto", coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> bool:
  """Starts `jax.distributed` when the run spans several processes; returns whether it did.

  mode: "off" never initialises; "on" always does (explicit arguments, else JAX's cluster auto-detection:
  SLURM, Cloud TPU pod slices, Open MPI); "auto" initialises when arguments are given, when
  JAX_COORDINATOR_ADDRESS is set, or in a multi-process SLURM / TPU / MPI environment, and otherwise runs
  as a single process. Must be called before any other JAX call that touches devices.
  """
  if mode not in ("auto", "on", "off"):
    raise ValueError(f"distributed mode must be 'auto', 'on' or 'off', got {mode!r}.")
  if mode == "off":
    return False
  explicit = coordinator_address is not None or os.environ.get(_ENV_COORDINATOR)
  if mode == "auto" and not (explicit or _multi_process_cluster()):
    return False
  if (num_processes is None) != (process_id is None):
    raise ValueError(f"Give both num_processes and process_id, or neither (cluster auto-detection); got "
                     f"num_processes={num_processes}, process_id={process_id}.")
  if num_processes is not None and not 0 <= process_id < num_processes:
    raise ValueError(f"process_id must be in [0, num_processes={num_processes}), got {process_id}.")
  kwargs = {}
  if coordinator_address or os.environ.get(_ENV_COORDINATOR):
    kwargs["coordinator_address"] = coordinator_address or os.environ[_ENV_COORDINATOR]
  if num_processes is not None:
    kwargs["num_processes"] = num_processes
  if process_id is not None:
    kwargs["process_id"] = process_id
  jax.distributed.initialize(**kwargs)
  return True


def is_primary() -> bool:
  """True on the one process that writes results, logs and checkpoints metadata (process 0)."""
  return jax.process_index() == 0


def to_host(tree: Any) -> Any:
  """numpy copies of a pytree of (possibly multi-process, sharded) global arrays; every process gets the
  whole of every array."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    return jax.tree.map(lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)), tree)
  return jax.tree.map(np.asarray, tree)


def barrier(name: str) -> None:
  """Blocks until every process reaches the barrier `name` (no-op in a single-process run); e.g. after
  process 0 wrote a file the others read."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    multihost_utils.sync_global_devices(name)
