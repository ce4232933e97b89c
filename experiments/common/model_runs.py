"""The loop every analysis binary runs: open the run directory, run each model into one results log, stop at
the item budget."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

from absl import logging

from experiments.common import checkpoints, run_dir


@dataclasses.dataclass(frozen=True)
class ModelRuns:
  """What a finished run hands its report: the directory, the results log, each model's meta, the seconds."""

  out: run_dir.RunDir
  log: run_dir.ResultsLog
  metas: list
  seconds: float


def run_models(output, settings: Any, models: Sequence[Any], runtime, task: str,
               run_model: Callable[[Any, Any, Any, run_dir.ResultsLog], Any],
               keys: tuple[str, ...] = ("model", "item")) -> ModelRuns | None:
  """Opens --output_dir (its run.json records `settings` and the checkpoints' identities), then for each model
  logs its prompt layout and sampler, loads its weights and calls run_model(settings, model, runtime, log) ->
  meta, every result going to results.jsonl keyed by the fields `keys`. Returns the finished run for the report, its directory created, on
  the primary process; None on the others and when --max_items_this_run stopped the run (the next one
  resumes)."""
  out = run_dir.RunDir(output.output_dir, {"settings": dataclasses.asdict(settings),
                                           "checkpoints": checkpoints.identities(models)},
                       overwrite=output.overwrite, primary=runtime.primary, inputs=run_dir.inputs_of(models, task))
  log = run_dir.ResultsLog(out, "results.jsonl", keys, output.max_items_this_run)
  metas, start = [], time.time()
  try:
    for model in models:
      logging.info("%s: %s prompts (dlm_jax.io.prompt_layout), sampler %s", model.label, model.prompt_format,
                   model.sampler)
      metas.append(run_model(settings, checkpoints.load_weights(model, runtime, settings.numerics), runtime, log))
  except run_dir.ItemBudget as stop:
    logging.info("%s", stop)
    return None
  if not runtime.primary:
    return None
  out.ensure()
  return ModelRuns(out=out, log=log, metas=metas, seconds=time.time() - start)
