"""A batch-invariant policy run on a batch sharded over several devices: the batch is replicated first.

In the batch-invariant mode every model call maps the rows one at a time (`row_by_row.forward_rows`, a
`lax.map`), so with the batch sharded over a mesh each trip gathers its row from the device holding it: an
all-gather inside the loop, and under a compute policy inside the policy's `lax.cond` / `lax.switch`
(`policy_call`, `reuse_call`). XLA's CPU runtime runs a control-flow thunk and an independent collective of
the same step (a batch-wide reduction of the sampler, e.g. LLaDA's "is any position before the block still
masked") in whatever order its threads reach them, so one device can wait in the row's all-gather while
another waits in the reduction: measured on 4 and on 2 host devices with dLLM-Cache's four-case switch, every
run ended in XLA's rendezvous timeout (the process is aborted after 40 s). The row-by-row loop already
computes every row on every device (in the compiled program the loop carries all the batch's rows on each
device), so placing the batch replicated before the program costs nothing it did not already cost, and with
replicated weights (a `data` mesh) it leaves no collective inside a branch. Each row's
numbers are unchanged (the same batch-1 program runs it); the trace comes back replicated.
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding, PartitionSpec


def _identity(x):
  """x itself (jitted with the replicated output sharding, it moves x)."""
  return x


def _sharded_mesh(x):
  """The mesh of x when it is a jax.Array whose batch axis is split over several devices, else None."""
  sharding = getattr(x, "sharding", None)
  if not isinstance(sharding, NamedSharding) or x.ndim == 0:
    return None
  return sharding.mesh if sharding.shard_shape(x.shape)[0] < x.shape[0] else None


def replicate_sharded_batch(*arrays):
  """The arrays (None kept), each one whose batch axis is sharded placed replicated on its mesh (a jitted
  identity, so it works when the array spans several processes); the others unchanged."""
  out = []
  for x in arrays:
    mesh = None if x is None else _sharded_mesh(x)
    if mesh is not None:
      x = jax.jit(_identity, out_shardings=NamedSharding(mesh, PartitionSpec()))(x)
    out.append(x)
  return tuple(out)
