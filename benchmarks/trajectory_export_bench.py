r"""Trajectory export benchmark: prompts per second of `experiments.export_trajectories` against the same sampling
without captures (issue 33 item 1: export rate ≥ 80% of plain sampling).

It takes the export binary's --checkpoints (one), --n_prompts, --batch_size, --sites, --export_steps and
--position_classes (defaults: the embedded tiny-dlm, 64 prompts in batches of 8, every layer's hook_resid_post,
every step, every position class) with the default decoding (float32, the model's default sampler — LLaDA
low-confidence remasking at temperature 0 — and its default lengths) and times, per round:
  plain    the sampler without hooks on every batch, tokens fetched to the host and scored for
           correctness (what a run that only decodes does);
  export   the export of the same batches into a fresh dataset directory: sampling with the captures, the
           confidence / entropy readout, the rows, the shard files written and fsynced
           (`experiments.export_trajectories.launch_batch`, `batch_shard` and `TrajectoryWriter.write_shard`, as
           the binary runs them: batch k + 1 is dispatched before shard k is built and written).
Both programs are compiled and run once first; then --rounds rounds run each in turn (so load from other
processes falls on both alike). Printed: prompts/s (wall and process CPU time) per variant, median over rounds,
the ratio export / plain per round and its median, the rows and bytes written, the CPU model and the load
average before and after.

  python -m benchmarks.trajectory_export_bench                      # tiny-dlm, 64 prompts, 3 rounds
  python -m benchmarks.trajectory_export_bench --export_steps=every:4 --position_classes=masked
  python -m benchmarks.trajectory_export_bench --quick              # 4 prompts, one round (smoke test)
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time


import jax
import numpy as np
from absl import app, flags

from benchmarks.machine import cpu_model
from dlm_jax.io.trajectory_dataset import TrajectoryWriter
from dlm_jax.session import decode_settings
from dlm_jax.session.decode_settings import DecodeSettings
from experiments import export_trajectories as ex
from experiments.common import checkpoints, decoding, devices, item_batches, items, prompts
from experiments.common.items import TaskSettings
from experiments.common.numerics import Numerics

_QUICK = flags.DEFINE_bool("quick", False, "4 prompts, one round (a smoke test; the figures mean nothing).")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Interleaved rounds (the median counts).")


def _clock():
  return time.perf_counter(), time.process_time()


def _since(start):
  wall, cpu = _clock()
  return wall - start[0], cpu - start[1]


def main(argv):
  del argv
  flag = flags.FLAGS
  n_prompts, rounds = (4, 1) if _QUICK.value else (flag.n_prompts, _ROUNDS.value)
  if len(flag.checkpoints) != 1:
    raise app.UsageError(f"--checkpoints={','.join(flag.checkpoints)}: the benchmark takes one checkpoint")
  runtime = devices.init_runtime(devices.RuntimeSettings())
  settings = ex.Settings(checkpoints=tuple(flag.checkpoints), n_prompts=n_prompts, batch_size=flag.batch_size,
                         sites=tuple(flag.sites), export_steps=flag.export_steps,
                         position_classes=tuple(flag.position_classes), task=TaskSettings(), decode=DecodeSettings(),
                         numerics=Numerics())
  model = checkpoints.prepare(flag.checkpoints[0], "auto", "auto")
  settings.check_model(model)
  model = checkpoints.load_weights(model, runtime, settings.numerics)
  values = decode_settings.model_settings(settings.decode, model)
  todo = items.load_items(items.task_name(settings.task.task, model.record), n_prompts, settings.task.data_seed)
  item_index = {item.id: i for i, item in enumerate(todo)}
  batches = list(item_batches.batches(todo, prompts.encode(model, todo), settings.batch_size, settings.decode.seed,
                                      runtime, lambda item: False))
  lp = batches[0].prompts.ids.shape[1]

  def plain():
    for batch in batches:
      trace = decoding.sampler(model, values, batch.prompts, runtime, settings.numerics, key=batch.key)()
      decoding.check_finite(trace)
      ex.score_answers(model, batch.items, np.asarray(trace.tokens)[:len(batch.items), lp:])

  def export(path):
    writer = TrajectoryWriter(path, model={"checkpoint": flag.checkpoints[0]}, settings={},
                              columns=ex.columns(settings, model), expected_shards=len(batches))
    pending = None
    for k, batch in enumerate([*batches, None]):  # as export_model: batch k + 1 sampled while shard k is written
      launched = None if batch is None else ex.launch_batch(settings, model, values, batch, runtime)
      if pending is not None:
        writer.write_shard(k - 1, ex.batch_shard(settings, model, pending, item_index))
      pending = launched
    return writer

  scratch = tempfile.mkdtemp(prefix="trajectory_bench-")
  load_before = os.getloadavg()
  try:
    plain()
    writer = export(os.path.join(scratch, "warm"))
    rows = sum(s["rows"] for s in writer.manifest["shards"])
    nbytes = sum(f["bytes"] for s in writer.manifest["shards"] for f in s["files"].values())
    times = {"plain": [], "export": []}
    for r in range(rounds):
      start = _clock()
      plain()
      times["plain"].append(_since(start))
      start = _clock()
      export(os.path.join(scratch, f"round{r}"))
      times["export"].append(_since(start))
      shutil.rmtree(os.path.join(scratch, f"round{r}"))
  finally:
    shutil.rmtree(scratch, ignore_errors=True)
  load_after = os.getloadavg()
  print(f"CPU: {cpu_model()}; JAX {jax.__version__}, backend {jax.default_backend()}")
  print(f"load average (1, 5, 15 min) before {load_before}, after {load_after}")
  print(f"{model.label}: {n_prompts} prompts in batches of {settings.batch_size}, gen_length {values['gen_length']}, "
        f"{values['steps']} steps; export: {rows} rows, {nbytes / 2**20:.1f} MiB per round "
        f"(sites {', '.join(ex.site_columns(settings, model))})")
  for clock, i in (("wall", 0), ("CPU", 1)):
    rate = {k: [n_prompts / t[i] for t in v] for k, v in times.items()}
    ratios = [e / p for e, p in zip(rate["export"], rate["plain"])]
    print(f"{clock:>4} time: plain {statistics.median(rate['plain']):.2f} prompts/s "
          f"({min(rate['plain']):.2f}-{max(rate['plain']):.2f}), export {statistics.median(rate['export']):.2f} "
          f"prompts/s ({min(rate['export']):.2f}-{max(rate['export']):.2f}); export / plain "
          f"{statistics.median(ratios):.3f} (rounds {', '.join(f'{x:.3f}' for x in ratios)})")


if __name__ == "__main__":
  app.run(main)
