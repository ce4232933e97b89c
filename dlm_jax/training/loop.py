"""The training loop: jitted steps over a deterministic data order, orbax checkpoints, resume, logging.

`train` runs `TrainConfig.steps` optimizer steps. Batch s is `Examples.batch(batch_indices(seed, s, B, N))`
and its noise key is `step_key(seed, s)`, so the data and the noise depend only on (seed, step). With a
`run_dir`, the state {params, opt_state, step} is saved by an orbax `CheckpointManager` every
`checkpoint_every` steps, at the end, and when SIGINT/SIGTERM arrives (the loop finishes the current step,
saves, and returns). Starting again with the same run_dir restores the latest checkpoint and continues,
so a run killed and resumed ends with exactly the parameters of an uninterrupted run. The run's
configuration is stored in `run_dir/run.json` and a resume with a different configuration is refused.

With a `mesh`, the state is created directly in its sharded layout (`training.train_state_shardings`: no
device ever holds the whole model), every batch is placed row-sharded over the batch axes, orbax saves
and restores the shards in place, and in a multi-process run only process 0 writes run.json and the
metrics (orbax coordinates the checkpoint itself). The returned parameters are gathered to the host.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import signal
import time
from typing import Any, Callable

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh

from dlm_jax.io import json_files
from dlm_jax.runtime import distributed, sharding
from dlm_jax.config import ModelConfig
from dlm_jax.training.objectives import (Objective, SinkTokenSpec, as_prng_key, init_train_state, loss_fn, make_optimizer,
                              make_train_step, step_key, train_state_shardings)
from dlm_jax.training.data import Examples, batch_indices
from dlm_jax.training.uniform import UniformNoise


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Everything that defines a training run besides the model config and the data.

  objective: "pretrain", "sft", "ar" or "uniform" (DiffusionGemma-style; `prompt_len` is then the prompt
  region of the batches and `self_conditioning_rate` its rate, `dlm_jax.training.uniform`). sink: "none", "front" or "end" (extra sink token);
  sink_token_id: its vocabulary id; zero_sink_value: keep its embedding (hence key and value) at zero.
  lr: peak learning rate after `warmup` linear steps, cosine-decayed to lr·end_lr_ratio at `steps`.
  checkpoint_every: orbax save interval in steps (0 = only at the end / on a signal).
  """

  objective: str = "sft"
  sink: str = "none"
  sink_token_id: int | None = None
  zero_sink_value: bool = False
  steps: int = 1000
  batch_size: int = 32
  lr: float = 1e-3
  warmup: int = 100
  end_lr_ratio: float = 0.1
  weight_decay: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  clip_norm: float = 1.0
  seed: int = 0
  checkpoint_every: int = 500
  log_every: int = 50
  attention_impl: str = "chunked"
  prompt_len: int | None = None
  self_conditioning_rate: float = 0.5

  def objective_spec(self) -> Objective:
    sink = None
    if self.sink != "none":
      if self.sink_token_id is None:
        raise ValueError("A sink token needs sink_token_id (a reserved vocabulary id).")
      sink = SinkTokenSpec(self.sink_token_id, self.sink, self.zero_sink_value)
    elif self.zero_sink_value:
      raise ValueError("zero_sink_value needs sink='front' or 'end'.")
    uniform = None
    if self.objective == "uniform":
      if self.prompt_len is None:
        raise ValueError("Objective 'uniform' needs prompt_len (the prompt region of the sft data layout).")
      uniform = UniformNoise(self.prompt_len, self_conditioning_rate=self.self_conditioning_rate)
    return Objective(self.objective, sink=sink, attention_impl=self.attention_impl, uniform=uniform)


@dataclasses.dataclass
class TrainResult:
  """params: final parameters; metrics: floats of the last step; resumed_from: restored step or None;
  stopped_early: a signal or `stop_after` ended the run before `steps`; wall_s: seconds in this call."""

  params: Any
  step: int
  metrics: dict[str, float]
  resumed_from: int | None
  stopped_early: bool
  wall_s: float


class _StopFlag:
  """Turns SIGINT/SIGTERM into a flag checked between steps (restored on exit)."""

  def __init__(self):
    self.raised = False
    self._previous = {}

  def __enter__(self):
    for sig in (signal.SIGINT, signal.SIGTERM):
      try:
        self._previous[sig] = signal.signal(sig, self._handle)
      except ValueError:  # not the main thread
        pass
    return self

  def _handle(self, signum, frame):
    del frame
    logging.warning("Signal %d: saving a checkpoint after this step and stopping.", signum)
    self.raised = True

  def __exit__(self, *exc):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)


def _run_record(model_config: ModelConfig, train_config: TrainConfig, examples: Examples) -> dict[str, Any]:
  return {"model_config": model_config.to_dict(), "train_config": dataclasses.asdict(train_config),
          "n_examples": len(examples), "seq_len": examples.seq_len}


def _check_run_record(run_dir: str, record: dict[str, Any], primary: bool) -> None:
  path = os.path.join(run_dir, "run.json")
  if os.path.exists(path):
    previous = json_files.read_json(path, ValueError)
    if not isinstance(previous.get("train_config"), dict):
      raise ValueError(f"{path}: field 'train_config' must be a JSON object; the file is not a training run record")
    ignore = {"log_every", "checkpoint_every"}
    stored = {**dataclasses.asdict(TrainConfig()), **previous["train_config"]}  # fields added later: defaults
    a = {**previous, "train_config": {k: v for k, v in stored.items() if k not in ignore}}
    b = {**record, "train_config": {k: v for k, v in record["train_config"].items() if k not in ignore}}
    if a != b:
      raise ValueError(f"{run_dir} holds a run with another configuration; use a new --run_dir.\n"
                       f"stored: {json.dumps(a, sort_keys=True)}\nnow:    {json.dumps(b, sort_keys=True)}")
    return
  if not primary:
    return
  os.makedirs(run_dir, exist_ok=True)
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(record, f, indent=2, sort_keys=True)
  os.replace(tmp, path)


@functools.lru_cache(maxsize=8)
def _optimizer_and_step(config: ModelConfig, objective: Objective, lr, steps, warmup, weight_decay, b1, b2, clip_norm,
                        end_ratio, mesh: Mesh | None):
  """The optimizer and its jitted train step, cached so that runs in one process compile once."""
  optimizer = make_optimizer(lr=lr, total_steps=steps, warmup_steps=warmup, weight_decay=weight_decay, b1=b1, b2=b2,
                             clip_norm=clip_norm, end_ratio=end_ratio)
  return optimizer, make_train_step(config, objective, optimizer, mesh)


def _initial_state(config: ModelConfig, seed: int, optimizer, objective: Objective, mesh: Mesh | None):
  """The step-0 state, created in its sharded layout on `mesh` (jit with out_shardings) when there is one."""
  if mesh is None:
    return init_train_state(config, jax.random.key(seed), optimizer, objective)
  layout = train_state_shardings(config, mesh, optimizer, objective)
  return jax.jit(lambda: init_train_state(config, jax.random.key(seed), optimizer, objective), out_shardings=layout)()


def _step_inputs(examples: Examples, tc: TrainConfig, step: int, mesh: Mesh | None):
  """(batch, noise key) of training step `step`, placed on `mesh` (rows sharded, key replicated)."""
  batch = examples.batch(batch_indices(tc.seed, step, tc.batch_size, len(examples)))
  key = step_key(tc.seed, step)
  if mesh is None:
    return batch, key
  return (sharding.put_rows(batch, mesh),
          sharding.put_host(np.asarray(jax.random.key_data(key)), sharding.replicated(mesh)))


def open_checkpoints(run_dir: str, state: Any, log: Callable[[str], Any], what: str = "") -> tuple[Any, Any, int | None]:
  """The orbax manager of `run_dir`/checkpoints (two kept, written synchronously) and the training state
  restored from its latest step: (manager, state, that step or None when nothing was saved yet). `what` names
  the run in the "resumed ..." log line."""
  manager = ocp.CheckpointManager(
      os.path.join(run_dir, "checkpoints"),
      options=ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=False, create=True))
  latest = manager.latest_step()
  if latest is None:
    return manager, state, None
  state = manager.restore(latest, args=ocp.args.StandardRestore(state))
  log(f"resumed {what}from step {int(latest)} in {run_dir}")
  return manager, state, int(latest)


def train(model_config: ModelConfig, train_config: TrainConfig, examples: Examples, *, run_dir: str | None = None,
          stop_after: int | None = None, log: Callable[[str], None] = logging.info,
          mesh: Mesh | None = None) -> TrainResult:
  """Trains from scratch or resumes from `run_dir` (module docstring); returns the final state.

  stop_after: stop (after saving) once this many steps are done — a deterministic stand-in for a kill.
  mesh: train sharded on this (data, fsdp, tensor) mesh; the batch size must divide over data × fsdp.
  """
  start_time = time.time()
  tc = train_config
  objective = tc.objective_spec()
  objective.check(model_config)
  if mesh is not None:
    sharding.check_batch(tc.batch_size, mesh)
  optimizer, train_step = _optimizer_and_step(model_config, objective, tc.lr, tc.steps, tc.warmup, tc.weight_decay,
                                              tc.b1, tc.b2, tc.clip_norm, tc.end_lr_ratio, mesh)
  state = _initial_state(model_config, tc.seed, optimizer, objective, mesh)
  primary = distributed.is_primary()
  manager, resumed_from = None, None
  if run_dir is not None:
    run_dir = os.path.abspath(run_dir)
    _check_run_record(run_dir, _run_record(model_config, tc, examples), primary)
    manager, state, resumed_from = open_checkpoints(run_dir, state, log)
  step = int(state["step"])
  end = tc.steps if stop_after is None else min(tc.steps, stop_after)
  metrics, step_metrics, stopped_early = {}, None, False
  metrics_file = None
  if run_dir is not None and primary:
    metrics_file = open(os.path.join(run_dir, "metrics.jsonl"), "a", encoding="utf-8")
  last_log_time, last_log_step = time.time(), step
  try:
    with _StopFlag() as stop:
      while step < end and not stop.raised:
        state, step_metrics = train_step(state, *_step_inputs(examples, tc, step, mesh))
        step += 1
        if tc.log_every and (step % tc.log_every == 0 or step == end):
          metrics = {k: float(v) for k, v in step_metrics.items()}
          now = time.time()
          rate = (step - last_log_step) / max(now - last_log_time, 1e-9)
          last_log_time, last_log_step = now, step
          log(f"step {step}/{tc.steps} loss {metrics['loss']:.4f} acc {metrics['accuracy']:.3f} "
              f"grad_norm {metrics['grad_norm']:.3f} steps/s {rate:.2f} elapsed {now - start_time:.0f}s")
          if metrics_file is not None:
            metrics_file.write(json.dumps({"step": step, **metrics, "steps_per_s": rate}) + "\n")
            metrics_file.flush()
        if manager is not None and tc.checkpoint_every and step % tc.checkpoint_every == 0 and step < end:
          manager.save(step, args=ocp.args.StandardSave(state))
      stopped_early = step < tc.steps
      if manager is not None and manager.latest_step() != step:
        manager.save(step, args=ocp.args.StandardSave(state), force=True)
      if step_metrics is not None:
        metrics = {k: float(v) for k, v in step_metrics.items()}
  finally:
    if manager is not None:
      manager.wait_until_finished()
      manager.close()
    if metrics_file is not None:
      metrics_file.close()
  params = distributed.to_host(state["params"])
  return TrainResult(params=params, step=step, metrics=metrics, resumed_from=resumed_from,
                     stopped_early=stopped_early, wall_s=time.time() - start_time)


def evaluate_loss(model_config: ModelConfig, train_config: TrainConfig, params: Any, examples: Examples,
                  n_batches: int = 4, seed: int = 1234, mesh: Mesh | None = None) -> float:
  """Mean objective loss over `n_batches` fixed batches of `examples` (noise from `seed`); host `params`
  are sharded over `mesh` when one is given."""
  objective = train_config.objective_spec()
  fn = jax.jit(lambda p, b, k: loss_fn(p, b, as_prng_key(k), config=model_config, objective=objective)[0])
  probe = dataclasses.replace(train_config, seed=seed)
  if mesh is not None:
    sharding.check_batch(train_config.batch_size, mesh)
    params = sharding.put_host(params, sharding.param_shardings(model_config, mesh, params))
  losses = [float(fn(params, *_step_inputs(examples, probe, i, mesh))) for i in range(n_batches)]
  return float(np.mean(losses))


# ----------------------------------------------------------------------------------------------------
# Converted checkpoint directories (config.json + model.safetensors + tokenizer.json [+ training.json]).


def save_converted(directory: str, config: ModelConfig, params: Any, tokenizer: Any = None,
                   training_record: dict[str, Any] | None = None) -> None:
  """Writes `directory` atomically with `dlm_jax.io.checkpoint.save` (config.json, model.safetensors), plus
  tokenizer.json given a `tokenizers.Tokenizer` and training.json given a record of the run. An existing
  directory is replaced."""
  from dlm_jax.io import checkpoint  # pylint: disable=import-outside-toplevel

  with checkpoint.atomic_output_dir(directory, overwrite=True) as tmp:
    checkpoint.save(tmp, config, params)
    if tokenizer is not None:
      tokenizer.save(os.path.join(tmp, "tokenizer.json"))
    if training_record is not None:
      with open(os.path.join(tmp, "training.json"), "w", encoding="utf-8") as f:
        json.dump(training_record, f, indent=2, sort_keys=True)


def load_converted(directory: str) -> tuple[ModelConfig, Any]:
  """(config, float32 params) of a converted directory (`dlm_jax.io.checkpoint.load`)."""
  from dlm_jax.io import checkpoint  # pylint: disable=import-outside-toplevel

  return checkpoint.load(directory, dtype=np.float32)
