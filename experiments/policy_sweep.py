"""Compute policies against accuracy: methods × budgets × sinks kept, on the embedded models' task, per item.

  python -m experiments.policy_sweep                                   # tiny-dlm, the synthetic task
  python -m experiments.policy_sweep --checkpoints=tiny-dlm,tiny-moe-dlm --n_prompts=64 \
      --policies=none,dkv_cache,sparse_dllm --keep_ratios=0.25,0.5,0.75 --keep_sinks=0,2 --reload_steps=2,4,8 \
      --condition=sparse_dllm:keep_ratio=0.5,kernel_size=1

Every condition decodes the same prompts with the same sampler settings (the analysis binaries' decoding flags,
exact decoding) under one compute policy (`dlm_jax.policy`): `none`; `dkv_cache` at each --reload_steps
(cache_reloading_step); `sparse_dllm` at each --keep_ratios × --keep_sinks (the previous step's top-K sinks kept
beside the scored keys: `keep_sinks`, ours); every other runnable method at its published defaults; and each
--condition (a whole policy text, repeatable). Per item it records whether the answer is correct, the model calls,
the trunk FLOPs the calls computed (each policy's analytic count, `ComputePolicy.call_flops`, of each step's
`Trace.computed_positions`, `Trace.keys_read` and `Trace.policy_record`; the LM head is the same for every
policy and left out) and the item's share of its batch's wall time. Results: results.jsonl (one line per model,
condition and item; a killed run resumes), summary.json / summary.md (per condition: accuracy, its change against
`none`, FLOPs per generated token and their ratio to `none`, calls, seconds), and per model a Pareto figure
(accuracy against FLOPs, one point per condition, labelled; the non-dominated ones joined).
"""

from __future__ import annotations

import dataclasses
import os
import time

import jax
import numpy as np
from absl import flags

from dlm_jax.analysis import policy_metrics
from dlm_jax.instrument.stats import StatsSpec
from dlm_jax.policy.base import RunLayout
from dlm_jax.policy.registry import parse_policy, policy_names
from dlm_jax.runtime import distributed
from dlm_jax.session import decode_settings
from dlm_jax.session.decode_settings import DecodeSettings
from dlm_jax.session.decoding_mode import DecodingMode
from experiments.common import (analysis_flags, atomic_files, cli, decoding, devices, flag_checks, item_batches, items,
                                model_runs, numerics, numerics_flags, progress, prompts, scoring)
from experiments.common.items import TaskSettings
from experiments.common.numerics import Numerics
from experiments.reports import summary_files

_CHECKPOINTS = flags.DEFINE_list("checkpoints", ["tiny-dlm"], "Converted checkpoints, or the embedded tiny-dlm, "
                                 "tiny-moe-dlm (masked diffusion models).")
_N_PROMPTS = flags.DEFINE_integer("n_prompts", 32, "Prompts per model (0 = the whole task).")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 8, "Prompts per sampler call (results do not depend on it).")
_POLICIES = flags.DEFINE_list("policies", list(policy_names()), "Methods (default: every runnable one): none, "
                              "dkv_cache and sparse_dllm over their budget flags, the others at their published "
                              "defaults.")
_CONDITIONS = flags.DEFINE_multi_string("condition", [], "A further condition: a whole policy text "
                                        "NAME:knob=value,... (repeat the flag for more).")
_KEEP_RATIOS = flags.DEFINE_list("keep_ratios", ["0.25", "0.5", "0.75"], "sparse_dllm budgets, each in (0, 1].")
_KEEP_SINKS = flags.DEFINE_list("keep_sinks", ["0", "2"], "sparse_dllm: sinks kept beside the scored keys (0: the "
                                "official rule).")
_RELOAD_STEPS = flags.DEFINE_list("reload_steps", ["2", "4", "8"], "dkv_cache budgets: cache_reloading_step.")


def conditions(policies: tuple[str, ...], keep_ratios: tuple[float, ...], keep_sinks: tuple[int, ...],
               reload_steps: tuple[int, ...], extra: tuple[str, ...] = ()) -> tuple[str, ...]:
  """The policy texts of the sweep (`dlm_jax.policy.registry.parse_policy`), `none` first: dkv_cache at each
  reload step, sparse_dllm at each keep ratio × sinks kept, any other method at its published defaults, then
  `extra` (whole policy texts) not already among them."""
  out = []
  for name in policies:
    if name == "dkv_cache":
      out += [f"dkv_cache:cache_reloading_step={r}" for r in reload_steps]
    elif name == "sparse_dllm":
      out += [f"sparse_dllm:keep_ratio={k:g},keep_sinks={s}" for k in keep_ratios for s in keep_sinks]
    elif name in policy_names():
      out.append(name)
    else:
      raise cli.UserError(f"--policies={','.join(policies)}: {name!r} is not one of {', '.join(policy_names())}")
  if "none" not in out:
    raise cli.UserError("--policies: expected none among them (the baseline every condition is compared with)")
  out += list(extra)
  return tuple(dict.fromkeys(["none"] + [c for c in out if c != "none"]))


@dataclasses.dataclass(frozen=True)
class Settings:
  """Everything that defines a policy_sweep run (recorded in run.json; flags of the same names)."""

  checkpoints: tuple[str, ...]
  n_prompts: int
  batch_size: int
  conditions: tuple[str, ...]
  task: TaskSettings
  decode: DecodeSettings
  numerics: Numerics

  def __post_init__(self):
    flag_checks.checkpoints_given(self.checkpoints)
    flag_checks.positive(batch_size=self.batch_size)
    flag_checks.item_count(n_prompts=self.n_prompts)
    for text in self.conditions:
      try:
        parse_policy(text)
      except ValueError as error:
        raise cli.UserError(f"--policies: {error}") from None


def _numbers(name: str, values: list[str], kind: type) -> tuple:
  try:
    return tuple(kind(v) for v in values)
  except ValueError:
    raise cli.UserError(f"--{name}={','.join(values)}: expected {kind.__name__} values") from None


def item_flops(config, policy, computed: np.ndarray, keys: np.ndarray, records, row: int) -> float:
  """Trunk FLOPs one row's calls computed, as the (bound) policy counts them (`ComputePolicy.call_flops`):
  computed [steps, B, S] bool, keys [steps, B] (keys per query), records: `Trace.policy_record` with a leading
  steps axis, or None."""
  total = 0.0
  for step in range(computed.shape[0]):
    record = None if records is None else jax.tree.map(lambda x: np.asarray(x)[step, row], records)
    total += policy.call_flops(config, computed[step, row], float(keys[step, row]), record)
  return total


def run_model(settings: Settings, model, runtime, log) -> dict:
  """Decodes every (condition, item) not done yet; returns the model's meta."""
  todo = items.load_items(items.task_name(settings.task.task, model.record), settings.n_prompts,
                          settings.task.data_seed)
  prompt_set = prompts.encode(model, todo)
  done = lambda item, c: log.done(model=model.label, policy=c, item=item.id)  # noqa: E731
  meter = progress.Progress(f"{model.label} (policy, prompt)", len(settings.conditions) * len(todo),
                            sum(done(i, c) for c in settings.conditions for i in todo))
  for condition in settings.conditions:
    values = decode_settings.model_settings(settings.decode, model, DecodingMode(policy=condition))
    for batch in item_batches.batches(todo, prompt_set, settings.batch_size, settings.decode.seed, runtime,
                                      lambda item: done(item, condition)):
      start = time.time()
      trace = decoding.generate(model, values, batch.prompts, runtime, settings.numerics, key=batch.key,
                                stats_spec=StatsSpec(incoming_attention=True, per_head=False))
      generated = distributed.to_host(trace.generated)
      seconds = time.time() - start
      n_steps = int(trace.nfe)
      s = batch.prompts.ids.shape[1] + values["gen_length"]
      if trace.computed_positions is None:
        computed = np.ones((n_steps, len(batch.items), s), bool)
        keys = np.full((n_steps, len(batch.items)), s, np.float64)
      else:
        computed = np.asarray(trace.computed_positions)[:n_steps]
        keys = np.asarray(trace.keys_read)[:n_steps]
      records = None if trace.policy_record is None else jax.tree.map(lambda x: np.asarray(x)[:n_steps],
                                                                      trace.policy_record)
      incoming = np.asarray(trace.stats["incoming_attention"])[:n_steps]
      block = values.get("block_length") or values["gen_length"]  # Dream's exact sampler: one block
      per_block = values["steps"] // max(values["gen_length"] // block, 1)
      policy = parse_policy(condition).bind(RunLayout(seq_len=s, gen_start=s - values["gen_length"],
                                                      block_length=block, steps_per_block=per_block,
                                                      logit_shift=model.config.logit_shift))
      kept_keys = records if policy.NAME == "sparse_dllm" else None  # Sparse-dLLM's record: its kept keys
      for row, item in enumerate(batch.items):
        if done(item, condition):
          continue
        _, text = prompts.completion(model, generated[row])
        record = {"model": model.label, "policy": condition, "item": item.id, "nfe": n_steps, "seq_len": s,
                  "flops": item_flops(model.config, policy, computed, keys, records, row),
                  "gen_length": values["gen_length"],
                  "seconds": seconds / len(batch.items), "completion": text,
                  "dropped_attention": policy_metrics.dropped_attention(incoming, kept_keys, row,
                                                                        s - values["gen_length"], block, per_block),
                  "correct": scoring.score(item, text, model.prompt_format == "chat")["correct"]}
        meter.update(int(log.append(record)))
  return {"label": model.label, "sampler": model.sampler, "settings": decode_settings.model_settings(settings.decode,
                                                                                                     model)}


def aggregate(records: list[dict], conditions: tuple[str, ...]) -> dict[str, dict]:
  """Per condition: items, accuracy, FLOPs per generated token, calls and seconds per item, and accuracy and
  FLOPs against `none` on the same items."""
  per = {}
  for condition in conditions:
    rows = [r for r in records if r["policy"] == condition]
    if rows:
      per[condition] = {"items": len(rows), "accuracy": float(np.mean([r["correct"] for r in rows])),
                        "flops_per_token": float(np.mean([r["flops"] / r["gen_length"] for r in rows])),
                        "nfe": float(np.mean([r["nfe"] for r in rows])),
                        "seconds": float(np.mean([r["seconds"] for r in rows]))}
      dropped = [r["dropped_attention"] for r in rows if r.get("dropped_attention") is not None]
      if dropped:
        per[condition]["dropped_attention"] = float(np.mean(dropped))
  base = per.get("none")
  for value in per.values():
    if base:
      value["accuracy_change"] = value["accuracy"] - base["accuracy"]
      value["flops_ratio"] = value["flops_per_token"] / base["flops_per_token"]
  return per


def pareto_figure(label: str, per: dict[str, dict]):
  """Accuracy against FLOPs per generated token, one labelled point per condition, the front joined."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=import-outside-toplevel
  figure, axis = plt.subplots(figsize=(8, 5))
  names = list(per)
  x = np.asarray([per[n]["flops_per_token"] / 1e6 for n in names])
  y = np.asarray([per[n]["accuracy"] for n in names])
  colours = {"none": "black", "dkv_cache": "tab:blue", "sparse_dllm": "tab:orange", "d2cache": "tab:green",
             "dllm_cache": "tab:red", "elastic_cache": "tab:purple", "sparsed": "tab:brown"}
  seen: dict[float, int] = {}
  shown: set[str] = set()
  for name, xi, yi in zip(names, x, y):
    method = name.split(":")[0]
    marker = "s" if "keep_sinks=0" not in name and method == "sparse_dllm" else "o"
    axis.scatter(xi, yi, color=colours.get(method, "grey"), marker=marker, s=40, zorder=3,
                 label=None if method in shown else method)
    shown.add(method)
    place = round(float(yi), 2)  # labels of points at (nearly) the same accuracy stacked
    seen[place] = seen.get(place, -1) + 1
    knobs = name.partition(":")[2].replace("cache_reloading_step", "reload").replace("keep_ratio", "keep")
    axis.annotate(knobs or method, (xi, yi), fontsize=7, xytext=(6, 3 - 10 * seen[place]), textcoords="offset points",
                  arrowprops=dict(arrowstyle="-", linewidth=0.4, color="grey") if seen[place] else None)
  order = np.argsort(x)
  front, best = [], -1.0
  for i in order:
    if y[i] > best:
      front.append(i)
      best = y[i]
  axis.plot(x[front], y[front], color="grey", linewidth=1, zorder=1, label="non-dominated")
  axis.set_xlabel("trunk MFLOPs per generated token (the calls the policy computed)")
  axis.set_ylabel("accuracy (exact match)")
  axis.set_title(f"{label}: accuracy against compute per policy (squares: sinks kept)")
  axis.legend(loc="lower right", fontsize=8)
  figure.tight_layout()
  return figure


def write_report(settings: Settings, out: str, metas: list[dict], records: list[dict], wall_s: float) -> str:
  lines = ["# Compute policies against accuracy: `experiments.policy_sweep`", "",
           f"{settings.n_prompts or 'all'} prompts per model, exact decoding, the sampler settings of each model "
           f"in run.json. Wall time {wall_s:.0f}s. FLOPs: the trunk's matmuls over the calls each policy computed "
           "(`dlm_jax.policy.cost`), per generated token.", "",
           "Dropped attention (Sparse-dLLM): at each block's selection step, the share of the incoming attention "
           "(every query, head mean) on the keys outside the block that falls on the keys the policy then drops.", "",
           "| model | policy | items | accuracy | Δ vs none | MFLOPs / token | × none | calls | s / item | dropped "
           "attention |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  summary, links = {}, [""]
  for meta in metas:
    rows = [r for r in records if r["model"] == meta["label"]]
    if not rows:
      continue
    per = aggregate(rows, settings.conditions)
    summary[meta["label"]] = per
    for name, v in per.items():
      dropped = f"{v['dropped_attention']:.3f}" if "dropped_attention" in v else "–"
      lines.append(f"| {meta['label']} | `{name}` | {v['items']} | {v['accuracy']:.3f} | "
                   f"{v.get('accuracy_change', float('nan')):+.3f} | {v['flops_per_token'] / 1e6:.2f} | "
                   f"{v.get('flops_ratio', float('nan')):.2f} | {v['nfe']:.0f} | {v['seconds']:.2f} | {dropped} |")
    model_dir = os.path.join(out, meta["label"])
    os.makedirs(model_dir, exist_ok=True)
    atomic_files.save_figure(pareto_figure(meta["label"], per), os.path.join(model_dir, "pareto.png"))
    links.append(f"- [{meta['label']}/pareto.png]({meta['label']}/pareto.png)")
  lines += links
  return summary_files.write(out, {"models": metas, "summary": summary, "wall_s": wall_s}, lines)


def main(argv):
  del argv
  shared = analysis_flags.from_flags("policy_sweep", _CHECKPOINTS)
  models = shared.prepare_models()
  runtime = devices.init_runtime(shared.runtime)
  settings = Settings(
      checkpoints=shared.checkpoints, n_prompts=_N_PROMPTS.value, batch_size=_BATCH_SIZE.value,
      conditions=conditions(tuple(_POLICIES.value), _numbers("keep_ratios", _KEEP_RATIOS.value, float),
                            _numbers("keep_sinks", _KEEP_SINKS.value, int),
                            _numbers("reload_steps", _RELOAD_STEPS.value, int), tuple(_CONDITIONS.value)),
      task=shared.task, decode=shared.decode, numerics=numerics_flags.from_flags(shared.runtime))
  for model in models:
    if model.sampler not in ("llada", "mmada", "dream"):
      raise cli.UserError(f"{model.label}: policy_sweep decodes masked diffusion models (llada, mmada, dream "
                          f"samplers), not the {model.sampler} sampler")
    for condition in settings.conditions:
      decode_settings.model_settings(settings.decode, model, DecodingMode(policy=condition))
  runs = model_runs.run_models(shared.output, settings, models, runtime, shared.task.task, run_model,
                               keys=("model", "policy", "item"))
  if runs is not None:
    progress.summary_banner(runs.out.path, write_report(settings, runs.out.path, runs.metas, runs.log.records,
                                                        runs.seconds))


if __name__ == "__main__":
  cli.run(main)
