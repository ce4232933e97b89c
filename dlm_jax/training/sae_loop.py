"""The SAE training loop: a deterministic batch order over an activation array, jitted optax steps (data-parallel
over a mesh), orbax checkpoints and resume.

Batch s holds rows `order[s·B : (s+1)·B]` of the endless sequence of per-epoch permutations of the N rows
(epoch e permuted by a generator seeded with (seed, e)), so the data depend only on (seed, step) and a resumed
run sees exactly the batches an uninterrupted one would. With a `run_dir`, the state {params, opt_state, step,
since_fired, scale} is saved by an orbax `CheckpointManager` every `checkpoint_every` steps and at the end; a
second call with the same run_dir restores the latest checkpoint and continues (a run with another
configuration or other data is refused, one line). With a `mesh`, every batch is sharded by rows over its batch
axes and the state is replicated, so the gradient is the all-reduced mean over the devices.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh

from dlm_jax.instrument import sae as sae_lib
from dlm_jax.io import json_files
from dlm_jax.runtime import sharding
from dlm_jax.training import loop as train_loop
from dlm_jax.training import sae_objectives as objectives


@dataclasses.dataclass(frozen=True)
class SAETrainConfig:
  """steps, batch_size (rows), lr, warmup (steps), seed; scale_rows: rows the input scale and b_dec's initial
  mean are computed from (the first batches of the order); checkpoint_every / log_every: steps (0 = never)."""

  steps: int = 2000
  batch_size: int = 256
  lr: float = 1e-3
  warmup: int = 50
  seed: int = 0
  scale_rows: int = 4096
  checkpoint_every: int = 500
  log_every: int = 100

  def check(self) -> None:
    for name in ("steps", "batch_size", "scale_rows"):
      if getattr(self, name) <= 0:
        raise ValueError(f"SAE training {name} must be a positive integer, got {getattr(self, name)!r}.")
    for name in ("warmup", "checkpoint_every", "log_every"):
      if getattr(self, name) < 0:
        raise ValueError(f"SAE training {name} must be >= 0, got {getattr(self, name)!r}.")
    if not self.lr > 0:
      raise ValueError(f"SAE training lr must be > 0, got {self.lr!r}.")


class ArrayBatches:
  """Batches of rows of an activation array [N, D] in the module's order: a NumPy array, a memory map, or anything
  with `shape`, `ndim` and indexing by a sorted integer array (a trajectory dataset's memory-mapped column); only
  the rows of one batch are read at a time."""

  def __init__(self, rows: np.ndarray, batch_size: int, seed: int):
    if rows.ndim != 2 or rows.shape[0] == 0:
      raise ValueError(f"SAE training data must be [rows, d_in] with rows > 0, got {list(rows.shape)}.")
    self.rows, self.batch_size, self.seed = rows, batch_size, seed

  @functools.lru_cache(maxsize=2)  # noqa: B019  (one instance per run; two epochs live at a boundary)
  def _permutation(self, epoch: int) -> np.ndarray:
    return np.random.default_rng([self.seed, epoch]).permutation(self.rows.shape[0])

  def indices(self, step: int) -> np.ndarray:
    """[B] the row indices of batch `step`."""
    n = self.rows.shape[0]
    start = step * self.batch_size
    positions = np.arange(start, start + self.batch_size)
    return np.concatenate([self._permutation(int(e))[positions[positions // n == e] % n]
                           for e in np.unique(positions // n)])

  def batch(self, step: int) -> np.ndarray:
    """[B, D] float32: the rows of batch `step`."""
    index = self.indices(step)
    order = np.argsort(index)
    out = np.empty((len(index), self.rows.shape[1]), np.float32)
    out[order] = np.asarray(self.rows[index[order]], np.float32)
    return out


@dataclasses.dataclass
class SAETrainResult:
  """sae: the trained SAE on raw activations; step: steps done; metrics: the last step's; resumed_from: the step
  a checkpoint was restored at (None: started fresh); history: the logged metrics; wall_s: seconds."""

  sae: sae_lib.SAE
  step: int
  metrics: dict[str, float]
  resumed_from: int | None
  history: list[dict[str, float]]
  wall_s: float


def _record(objective: objectives.SAEObjective, config: SAETrainConfig, data: ArrayBatches) -> dict[str, Any]:
  kept = {k: v for k, v in dataclasses.asdict(config).items() if k not in ("checkpoint_every", "log_every")}
  return {"objective": dataclasses.asdict(objective), "config": kept, "data_rows": int(data.rows.shape[0]),
          "d_in": int(data.rows.shape[1])}


def _check_record(run_dir: str, record: dict[str, Any]) -> None:
  path = os.path.join(run_dir, "run.json")
  if os.path.exists(path):
    stored = json_files.read_json(path, ValueError)
    if stored != json.loads(json.dumps(record)):
      differing = sorted(k for k in set(stored) | set(record) if stored.get(k) != json.loads(json.dumps(record.get(k))))
      raise ValueError(f"{run_dir} holds an SAE training run with other settings ({', '.join(differing)} differ); "
                       "use a new run directory.")
    return
  os.makedirs(run_dir, exist_ok=True)
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(record, f, indent=1, sort_keys=True)
  os.replace(tmp, path)


@functools.lru_cache(maxsize=8)
def _compiled_step(objective: objectives.SAEObjective, lr: float, steps: int, warmup: int):
  optimizer = objectives.make_optimizer(lr, steps, warmup)
  return optimizer, jax.jit(functools.partial(objectives.train_step, objective=objective, optimizer=optimizer),
                            donate_argnums=(0,))


def train_sae(objective: objectives.SAEObjective, config: SAETrainConfig, data: ArrayBatches, *,
              run_dir: str | None = None, mesh: Mesh | None = None, stop_after: int | None = None,
              log: Callable[[str], None] = logging.info) -> SAETrainResult:
  """Trains (or resumes from `run_dir`) an SAE on the rows of `data` (module docstring).

  stop_after: stop (after saving) once this many steps are done — a deterministic stand-in for a kill."""
  start = time.time()
  objective.check()
  config.check()
  if data.rows.shape[1] != objective.d_in:
    raise ValueError(f"the SAE's d_in is {objective.d_in}, but the data rows have {data.rows.shape[1]} values.")
  if data.batch_size != config.batch_size:
    raise ValueError(f"the data's batch size {data.batch_size} differs from the config's {config.batch_size}.")
  if mesh is not None:
    sharding.check_batch(config.batch_size, mesh)
  optimizer, step_fn = _compiled_step(objective, config.lr, config.steps, config.warmup)
  n_first = -(-min(config.scale_rows, data.rows.shape[0]) // config.batch_size)
  first = np.concatenate([data.batch(s) for s in range(n_first)])
  scale = objectives.data_scale(first)
  state = objectives.init_state(objective, optimizer, jax.random.key(config.seed), np.mean(first * scale, axis=0),
                                scale)
  place_state = (lambda s: s) if mesh is None else (lambda s: sharding.put_host(s, sharding.replicated(mesh)))
  place_batch = (lambda b: b) if mesh is None else (lambda b: sharding.put_rows(b, mesh))
  state = place_state(jax.device_get(state))
  manager, resumed_from, history = None, None, []
  if run_dir is not None:
    run_dir = os.path.abspath(run_dir)
    _check_record(run_dir, _record(objective, config, data))
    manager, state, resumed_from = train_loop.open_checkpoints(run_dir, state, log, "SAE training ")
  step = int(state["step"])
  end = config.steps if stop_after is None else min(config.steps, stop_after)
  metrics: dict[str, float] = {}
  last_time, last_step = time.time(), step
  try:
    while step < end:
      state, step_metrics = step_fn(state, place_batch(data.batch(step)))
      step += 1
      if config.log_every and (step % config.log_every == 0 or step == end):
        metrics = {k: float(v) for k, v in step_metrics.items()}
        now = time.time()
        rate = (step - last_step) / max(now - last_time, 1e-9)
        last_time, last_step = now, step
        history.append({"step": step, **metrics})
        log(f"SAE step {step}/{config.steps} mse {metrics['mse']:.4f} explained variance "
            f"{metrics['explained_variance']:.3f} L0 {metrics['l0']:.1f} dead {metrics['dead_fraction']:.3f} "
            f"steps/s {rate:.1f}")
      if manager is not None and config.checkpoint_every and step % config.checkpoint_every == 0 and step < end:
        manager.save(step, args=ocp.args.StandardSave(state))
    if manager is not None and manager.latest_step() != step:
      manager.save(step, args=ocp.args.StandardSave(state), force=True)
  finally:
    if manager is not None:
      manager.wait_until_finished()
      manager.close()
  host = jax.device_get(state)
  return SAETrainResult(sae=objectives.to_sae(host["params"], float(host["scale"]), objective), step=step,
                        metrics=metrics, resumed_from=resumed_from, history=history, wall_s=time.time() - start)
