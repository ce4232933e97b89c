r"""The sink paper's Table 1 through lm-evaluation-harness: accuracy with the previous step's top-K sinks masked,
one lm-eval run per (model, K), on lm-eval tasks (the local synthetic task by default).

  python -m experiments.lm_eval.table1                     # tiny-dlm and tiny-arm, synthetic task, K = 0,1,5,10
  python -m experiments.lm_eval.table1 --checkpoints=llada=/ckpt/llada-8b-instruct --tasks=gsm8k,humaneval \
      --model_args=gen_length=256+steps=256+block_length=32+dtype=bfloat16 --limit=0 --confirm_run_unsafe_code

Each condition is `simple_evaluate` of the `dlm_jax` model with mask_sinks=K (K = 0: unmasked) and the
--model_args given ("+"-separated key=value pairs here, since the flag is a comma list of nothing else);
a model's weights are loaded once for all its conditions. Outputs in --output_dir (default
results/lm_eval_table1), each written atomically: <label>/K<k>/results.json (lm-eval's results, configs
and versions) and <label>/K<k>/samples_<task>.jsonl (lm-eval's logged samples) per condition — a condition
whose results.json exists is not run again — then table.md and table.json: accuracy ± binomial standard
error per K (rows) and model × task (columns), in `experiments.sink_masking_eval`'s layout. The
accuracy is each task's first metric (for the synthetic generation task, exact match after the
strict "#### n" filter).
"""

from __future__ import annotations

import json
import os

from absl import flags

from dlm_jax import extras
from experiments.common import atomic_files, cli, flag_checks
from experiments.reports import masking_report
from experiments.lm_eval.__main__ import TASKS_DIR

_CHECKPOINTS = flags.DEFINE_list("checkpoints", ["tiny-dlm", "tiny-arm"], "Checkpoint entries ([LABEL=]DIR or an "
                                 "embedded name).")
_MASK_TOP_K = flags.DEFINE_list("mask_top_k", ["0", "1", "5", "10"], "Numbers K >= 0 of sinks to mask (0 = none).")
_TASKS = flags.DEFINE_list("tasks", ["dlm_synthetic_gen"], "lm-eval task names.")
_LIMIT = flags.DEFINE_integer("limit", 16, "Items per task (0 = all).")
_NUM_FEWSHOT = flags.DEFINE_integer("num_fewshot", None, "lm-eval's --num_fewshot (default: the task's).")
_MODEL_ARGS = flags.DEFINE_string("model_args", "gen_length=32+steps=32+block_length=8+prompt_format=training", "Extra model_args for "
                                  "every model, KEY=VALUE joined by '+'.")
_INCLUDE_PATH = flags.DEFINE_string("include_path", TASKS_DIR, "Directory of extra lm-eval task YAMLs.")
_OUTPUT_DIR = flags.DEFINE_string("output_dir", None, "Results directory (default: results/lm_eval_table1).")
_UNSAFE = flags.DEFINE_bool("confirm_run_unsafe_code", False, "lm-eval's flag for code-executing tasks (HumanEval).")


def extra_args(text: str) -> dict[str, str]:
  """{key: value} of 'k=v+k=v' (a one-line error on a malformed pair)."""
  pairs = {}
  for part in filter(None, text.split("+")):
    key, sep, value = part.partition("=")
    if not sep or not key:
      raise cli.UserError(f"--model_args={text}: expected KEY=VALUE pairs joined by '+', got {part!r}")
    pairs[key.strip()] = value.strip()
  return pairs


def first_metric(results: dict) -> tuple[str, float, int]:
  """(name, value, n) of a task's first numeric metric in lm-eval's results (stderr entries skipped)."""
  for name, value in results.items():
    if "," in name and "_stderr" not in name and isinstance(value, (int, float)):
      return name, float(value), int(results.get("sample_len", 0))
  raise cli.UserError(f"lm-eval's results hold no metric: {sorted(results)}")


def run_condition(lm, k: int, tasks: list[str], manager, out_dir: str) -> dict:
  """lm-eval's results of one condition (read back when written before)."""
  from lm_eval import simple_evaluate, utils  # pylint: disable=import-outside-toplevel
  path = os.path.join(out_dir, "results.json")
  if os.path.isfile(path):
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  lm.set_mask_sinks(k)
  out = simple_evaluate(model=lm, tasks=tasks, limit=_LIMIT.value or None, num_fewshot=_NUM_FEWSHOT.value,
                        task_manager=manager, log_samples=True, bootstrap_iters=0,
                        confirm_run_unsafe_code=_UNSAFE.value)
  samples = out.pop("samples")
  dump = lambda value: json.dumps(value, default=utils.handle_non_serializable)
  for task, rows in samples.items():
    atomic_files.write_text(os.path.join(out_dir, f"samples_{task}.jsonl"), "".join(dump(r) + "\n" for r in rows))
  results = json.loads(dump(out))
  atomic_files.write_text(path, json.dumps(results, indent=1) + "\n")
  return results


def main(argv):
  del argv
  extras.require("lm_eval", "eval", "experiments.lm_eval.table1")
  from lm_eval.tasks import TaskManager  # pylint: disable=import-outside-toplevel
  from experiments.common import checkpoints  # pylint: disable=import-outside-toplevel
  from experiments.lm_eval.model import DlmJaxLM  # pylint: disable=import-outside-toplevel
  ks = list(cli.int_list(_MASK_TOP_K.value, "mask_top_k"))
  if not ks or min(ks) < 0 or len(set(ks)) != len(ks):
    raise cli.UserError(f"--mask_top_k={','.join(map(str, ks))}: expected distinct integers >= 0")
  if _LIMIT.value < 0:
    raise cli.UserError(f"--limit={_LIMIT.value}: expected >= 0 (0 = all items)")
  extra = extra_args(_MODEL_ARGS.value)
  entries = [checkpoints.resolve(entry) for entry in _CHECKPOINTS.value]
  flag_checks.not_blank(output_dir=_OUTPUT_DIR.value)
  output = os.path.abspath(_OUTPUT_DIR.value or os.path.join("results", "lm_eval_table1"))
  manager = TaskManager(include_path=_INCLUDE_PATH.value or None)
  table, metas, record = {}, [], {}
  for label, directory in entries:
    lm = DlmJaxLM(checkpoint=directory, **extra)
    for task in _TASKS.value:
      key = label if len(_TASKS.value) == 1 else f"{label} {task}"
      metas.append({"label": key, "task": task})
      table[key] = {}
    for k in ks:
      results = run_condition(lm, k, list(_TASKS.value), manager, os.path.join(output, label, f"K{k}"))
      for task in _TASKS.value:
        key = label if len(_TASKS.value) == 1 else f"{label} {task}"
        metric, value, n = first_metric(results["results"][task])
        table[key][str(k)] = {"n": n, "accuracy": value, "se": masking_report.binomial_se(value, n)}
        record.setdefault(key, {})[str(k)] = {"metric": metric, "value": value, "n": n}
  markdown = ("## Accuracy with the previous step's top-K sinks masked (lm-evaluation-harness)\n\n"
              + masking_report.accuracy_markdown(table, metas, ks) + "\n")
  atomic_files.write_text(os.path.join(output, "table.md"), markdown)
  atomic_files.write_json(os.path.join(output, "table.json"), {"conditions": ks, "columns": metas, "cells": record})
  print(markdown)


if __name__ == "__main__":
  cli.run(main)
