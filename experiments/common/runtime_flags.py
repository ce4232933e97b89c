"""Runtime flags of the binaries that run a model, turned into `devices.RuntimeSettings`.

  --mesh                 e.g. "data:2,fsdp:2,tensor:2" (default: no mesh, one device); the product may be
                         smaller than the number of devices (the first devices are used)
  --distributed          auto|on|off: `dlm_jax.runtime.distributed.initialize` before anything touches devices
  --coordinator_address  host:port of process 0 (else JAX_COORDINATOR_ADDRESS or cluster auto-detection)
  --num_processes        processes in the run (with --coordinator_address, outside SLURM/TPU/MPI)
  --process_id           this process's rank (same)
  --cpu_devices          N > 0 asks the CPU backend for N virtual devices (to try meshes on a CPU)
  --matmul_precision     jax_default_matmul_precision (changes results: recorded with them)
  --xla_cpu_options      auto|default|eigen|ynn_fused|onednn: XLA CPU options (`dlm_jax.runtime.xla_cpu`; rounding only)
"""

from __future__ import annotations

from absl import flags

from dlm_jax.runtime import xla_cpu
from experiments.common.devices import RuntimeSettings

_MESH = flags.DEFINE_string("mesh", "", "Device mesh, e.g. 'data:2,fsdp:2,tensor:2' (empty: single device); "
                            "may use fewer devices than there are.")
_DISTRIBUTED = flags.DEFINE_enum("distributed", "auto", ["auto", "on", "off"],
                                 "jax.distributed start-up (multi-host runs).")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None,
                                   "host:port of process 0 for jax.distributed (multi-process runs).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Number of processes of a multi-process run.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "Rank of this process in a multi-process run.")
_CPU_DEVICES = flags.DEFINE_integer("cpu_devices", 0, "Virtual CPU devices (0 = backend default); for trying "
                                    "--mesh on a CPU.")
_MATMUL_PRECISION = flags.DEFINE_enum("matmul_precision", "highest", ["default", "high", "highest"],
                                      "jax_default_matmul_precision.")
_XLA_CPU_OPTIONS = flags.DEFINE_string("xla_cpu_options", "auto", "XLA CPU option set (dlm_jax.runtime.xla_cpu): "
                                       f"{'|'.join(xla_cpu.CHOICES)}; auto picks by CPU vendor (README: Speed).")


def from_flags() -> RuntimeSettings:
  """The runtime flags as validated `RuntimeSettings`; also puts the --xla_cpu_options set into XLA_FLAGS
  now, the earliest point of every binary (before anything can create a JAX backend; `init_runtime`
  applies it again, which then adds nothing)."""
  settings = RuntimeSettings(mesh=_MESH.value, distributed=_DISTRIBUTED.value, coordinator_address=_COORDINATOR.value,
                             num_processes=_NUM_PROCESSES.value, process_id=_PROCESS_ID.value,
                             cpu_devices=_CPU_DEVICES.value, matmul_precision=_MATMUL_PRECISION.value,
                             xla_cpu_options=_XLA_CPU_OPTIONS.value)
  xla_cpu.apply(settings.xla_cpu_options)
  return settings
