r"""Attention sinks in diffusion language models (Rulli et al., paper A §4): generations with per-step
attention statistics, then the paper's figures and tables.

  python -m experiments.sink_analysis                       # embedded tiny DLM and ARM, a few minutes on a CPU
  python -m experiments.sink_analysis --checkpoints=smollm2 # SmolLM2-135M-Instruct (its first-token sink)
  python -m experiments.sink_analysis --checkpoints=llada=/ckpt/llada-8b-instruct,dream=/ckpt/dream-7b \
      --samplers=llada,dream --task=gsm8k_test.jsonl --n_prompts=30 --gen_length=128 --steps=128 \
      --block_length=32 --layers=0,15,31 --batch_size=4 --dtype=bfloat16 --mesh=fsdp:8

For every checkpoint (DLMs through their sampler, ARMs through KV-cache decoding) it generates from
--n_prompts prompts, recording at every step the incoming attention of every key per layer and head
(column sums over queries; for DLMs also split into masked and unmasked queries). Scores are relative
to the uniform share (`dlm_jax.sinks.relative_scores`: identical to the column sums for a full
bidirectional map; an ARM step's single query row over n written keys is scaled by n), and a key is a
sink when its score exceeds the mean of the others by ε (Eq. 3, ε = 3 by default).

Outputs in --output_dir (default results/sink_analysis):
  results.jsonl                one line per (model, prompt): completion, per-item summaries
  <model>/item_<id>.npz        per-step arrays of the --figure_item generation
  <model>/fig1_incoming_heatmap.png   incoming attention per key across steps (selected layers, head mean)
  <model>/fig5_main_sink_grid.png     per-(layer, head) main-sink score, averaged over steps and prompts
  <model>/fig7_largest_sink.png       position of the largest sink against the step for chosen heads
  <model>/fig6a_query_groups.png      DLMs: sinks of masked vs unmasked queries (last selected layer)
  <model>/prefill_incoming.png        ARMs: incoming attention over the prompt at the prefill, per layer
  fig3_score_histogram.png, fig10_nonsink_fraction.png   all models
  summary.json, summary.md     Table 2 (most frequent sink tokens), moving-sink measures, first-token
                               sink, separate sinks, non-sink fraction at ε — against the paper's numbers
"""

from __future__ import annotations

import collections
import os
import time
import warnings

import jax
import numpy as np
from absl import app, flags, logging

from dlm_jax import distributed, sinks
from dlm_jax.stats import StatsSpec
from experiments import common, devices, sink_report, workload

FLAGS = flags.FLAGS
flags.DEFINE_list("checkpoints", ["tiny-dlm", "tiny-arm"], "Checkpoints ([label=]DIR or tiny-dlm, tiny-arm, smollm2).")
flags.DEFINE_integer("n_prompts", 16, "Prompts (generations) per model.")
flags.DEFINE_integer("batch_size", 8, "Prompts per sampler call (rounded up to a multiple of the batch shards).")
flags.DEFINE_float("epsilon", 3.0, "ε of the sink rule (Eq. 3).")
flags.DEFINE_list("layers", [], "Layers to record (default: all).")
flags.DEFINE_bool("split_queries", True, "DLMs: also record incoming attention of masked / unmasked queries.")
flags.DEFINE_list("track_heads", [], "LAYER:HEAD pairs for Fig. 7 (default: the 3 heads with the largest "
                  "main-sink score).")
flags.DEFINE_string("figure_item", "0", "Item id whose generation is drawn in the per-generation figures.")
flags.DEFINE_float("histogram_max", 50.0, "Upper edge of the score histogram (larger scores go in the last bin).")
flags.DEFINE_integer("top_tokens", 8, "Rows of the sink-token table.")

EPSILON_GRID = np.round(np.arange(0.0, 10.01, 0.25), 2)
HIST_BINS = 100


def _stats_spec(model: workload.Model, n_layers: int) -> StatsSpec:
  layers = tuple(int(x) for x in FLAGS.layers) if FLAGS.layers else None
  if layers is not None and any(not 0 <= i < n_layers for i in layers):
    raise SystemExit(f"--layers {FLAGS.layers} outside the {n_layers} layers of {model.label}.")
  grouped = model.diffusion and FLAGS.split_queries
  return StatsSpec(incoming_attention=True, per_head=True, layers=layers, query_groups=3 if grouped else 0)


def analyse_row(model: workload.Model, item: workload.Item, prompts, host, row: int, layers: list[int],
                edges: np.ndarray) -> tuple[dict, dict]:
  """Per-item summaries (a JSON-able record) and the per-step arrays kept for the figure item."""
  lp = prompts.ids.shape[1]
  tokens, decode_step = host["tokens"][row], host["decode_step"][row]
  incoming = np.asarray(host["incoming"][:, :, row], np.float32)  # [steps, L', (3,) N, S]
  grouped = model.diffusion and FLAGS.split_queries  # as in _stats_spec: the [steps, L', 3, N, S] layout
  all_queries = incoming.sum(axis=2) if grouped else incoming  # pad queries are in no statistic
  steps, total = all_queries.shape[0], all_queries.shape[-1]
  valid, active = workload.step_validity(model, prompts, row, tokens, steps)
  valid4 = valid[:, None, None, :]
  scores = np.asarray(sinks.relative_scores(all_queries, valid4))  # [steps, L', N, S]
  sink_mask = np.asarray(sinks.epsilon_rule(scores, FLAGS.epsilon, "sum", valid4))
  n_entries = int(np.broadcast_to(valid4, scores.shape).sum())
  mask_id = model.config.mask_token_id if model.diffusion else None
  canvas = sinks.step_canvases(tokens[None], decode_step[None], lp, steps, mask_id=mask_id)[:, 0]  # [steps, S]

  hist, _ = np.histogram(np.minimum(scores[np.broadcast_to(valid4, scores.shape)], edges[-1] - 1e-6), bins=edges)
  nonsink = n_entries - sinks.sink_counts_over_epsilon(scores, EPSILON_GRID, valid4)
  main_score = np.where(valid4, scores, -np.inf).max(-1)[active]  # [active steps, L', N]
  largest = np.asarray(sinks.largest_sink_positions(scores, FLAGS.epsilon, "sum", valid4))  # [steps, L', N]
  counts = sinks.sink_token_counts(sink_mask, canvas[:, None, None, :])
  token_counts = collections.Counter()
  for token_id, n in counts.items():
    token_counts[model.tokenizer.id_to_token(int(token_id)) if token_id >= 0 else "<unwritten>"] += n

  centroids = np.asarray(sinks.sink_centroids(scores, sink_mask))  # [steps, L', N]
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", RuntimeWarning)
    moving = {
        "change_rate": np.nanmean(sinks.largest_sink_change_rate(largest), axis=-1),
        "drift": np.nanmean(sinks.largest_sink_drift(largest), axis=-1),
        "signed_drift": np.nanmean(sinks.largest_sink_drift(largest, signed=True), axis=-1),
        "centroid_variance": np.nanmean(np.nanvar(centroids, axis=0), axis=-1),
        "mean_lifetime": np.asarray([np.mean(x) if (x := sinks.sink_lifetimes(sink_mask[:, l])).size else np.nan
                                     for l in range(len(layers))]),
        "sinks_per_head": sink_mask[active].sum(-1).mean(axis=(0, 2)),
        "steps_with_sink": (largest[active] >= 0).mean(axis=(0, 2)),
    }
  pad = model.config.pad_token_id
  real = np.flatnonzero(valid.any(0)[:lp] & (tokens[:lp] != pad if pad is not None else True))
  first = int(real[0]) if real.size else 0  # the first real prompt token (BOS when there is one)
  shares = all_queries[..., first] / np.maximum(np.where(valid4, all_queries, 0).sum(-1), 1e-30)
  has = largest >= 0
  record = {
      "model": model.label, "item": item.id, "prompt": item.question,
      "completion": workload.completion(model, tokens[lp:])[1], "steps": steps, "prompt_length": lp,
      "first_real_position": first,
      "score_histogram": hist, "n_entries": n_entries, "nonsink_counts": nonsink,
      "sink_fraction": float(sink_mask.sum() / max(n_entries, 1)),
      "main_sink_grid": main_score.mean(0), "token_counts": dict(token_counts),
      "moving": {k: np.asarray(v, np.float64) for k, v in moving.items()},
      "first_token_share": shares[active].mean(axis=(0, 2)), "active_steps": int(active.sum()),
      "largest_at_first_token": float(((largest == first) & has).sum() / max(has.sum(), 1)),
      "largest_in_prompt": float(((largest < lp) & has).sum() / max(has.sum(), 1)),
  }
  if item.kind != "humaneval":
    record["correct"] = workload.score(item, record["completion"], model.prompt_format == "chat")["correct"]
  arrays = {"layer_scores": scores.mean(2), "largest": largest, "tokens": tokens, "decode_step": decode_step,
            "valid": valid, "layers": np.asarray(layers), "prompt_length": np.asarray(lp)}
  if grouped:
    masked_q = incoming[:, :, 0]
    unmasked_q = incoming[:, :, 1] + incoming[:, :, 2]
    n_masked = (canvas == model.config.mask_token_id).sum(-1)
    both_groups = np.broadcast_to(((n_masked > 0) & (n_masked < total))[:, None], (steps, masked_q.shape[2]))
    masked_keys, unmasked_keys = np.where(valid4, masked_q, -1.0), np.where(valid4, unmasked_q, -1.0)
    separate = [sinks.main_sink_disagreement(masked_keys[:, l], unmasked_keys[:, l], both_groups)
                for l in range(len(layers))]
    record["separate_sinks"] = [d / c if c else float("nan") for d, c in separate]
    arrays["group_incoming"] = np.stack([masked_q.mean(2), unmasked_q.mean(2)], axis=2)  # [steps, L', 2, S]
  return record, arrays


def run_model(model: workload.Model, runtime: devices.Runtime, log: common.ResultsLog, out: str) -> dict:
  """Generates and analyses the model's prompts not done yet; returns its metadata for the report."""
  config = model.config
  spec = _stats_spec(model, config.n_layers)
  layers = list(spec.layers) if spec.layers is not None else list(range(config.n_layers))
  items = workload.load_items(workload.task_name(model), FLAGS.n_prompts)
  batch = runtime.round_batch(FLAGS.batch_size)
  batches = common.fixed_batches(len(items), batch)
  edges = np.linspace(0.0, FLAGS.histogram_max, HIST_BINS + 1)
  model_dir = os.path.join(out, model.label)
  if runtime.primary:
    os.makedirs(model_dir, exist_ok=True)
  done = sum(log.done(model=model.label, item=it.id) for it in items)
  progress = common.Progress(f"{model.label} prompts", len(items), done)
  for index, rows in enumerate(batches):
    chunk = [items[i] for i in rows]
    if all(log.done(model=model.label, item=it.id) for it in chunk):
      continue
    prompts = workload.encode_prompts(model, chunk)
    padded = workload.Prompts(common.pad_rows(prompts.ids, batch),
                              None if prompts.mask is None else common.pad_rows(prompts.mask, batch), prompts.rows)
    start = time.time()
    trace = workload.generate(model, padded, runtime, key=jax.random.fold_in(jax.random.key(FLAGS.seed), index),
                              stats_spec=spec)
    host = distributed.to_host({"tokens": trace.tokens, "decode_step": trace.decode_step,
                           "incoming": trace.stats["incoming_attention"]})
    for row, item in enumerate(chunk):
      if log.done(model=model.label, item=item.id):
        continue
      record, arrays = analyse_row(model, item, padded, host, row, layers, edges)
      if item.id == FLAGS.figure_item and runtime.primary:
        common.write_npz(os.path.join(model_dir, f"item_{item.id}.npz"), **arrays)
      log.append(record)
      progress.update(1, f"{time.time() - start:.1f}s for the batch")
  return {"label": model.label, "directory": common.display_path(model.directory), "sampler": model.sampler, "layers": layers,
          "n_heads": config.n_heads, "diffusion": model.diffusion, "task": workload.task_name(model),
          "prompt_format": model.prompt_format, "settings": workload.sampler_settings(model),
          "block_length": workload.sampler_settings(model).get("block_length")}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  runtime = devices.init_runtime()
  out = common.output_dir("sink_analysis")
  entries = FLAGS.checkpoints
  samplers = workload.samplers_for(entries)
  settings = {name: FLAGS[name].value for name in (
      "checkpoints", "samplers", "n_prompts", "batch_size", "epsilon", "layers", "split_queries", "task",
      "data_seed", "prompt_format", "gen_length", "steps", "block_length", "temperature", "cfg_scale",
      "remasking", "alg", "alg_temp", "top_p", "top_k", "seed", "histogram_max")}
  common.prepare_output_dir(out, runtime, settings)
  log = common.ResultsLog(os.path.join(out, "results.jsonl"), ("model", "item"), runtime.primary)
  metas, stopped = [], False
  start = time.time()
  try:
    for entry, sampler in zip(entries, samplers):
      model = workload.load_model(entry, sampler, runtime)
      metas.append(run_model(model, runtime, log, out))
  except common.ItemBudget as stop:
    logging.info("%s", stop)
    stopped = True
  if runtime.primary and not stopped:
    text = sink_report.write_report(out, metas, log.records, EPSILON_GRID, FLAGS.epsilon,
                                    np.linspace(0.0, FLAGS.histogram_max, HIST_BINS + 1), FLAGS.track_heads,
                                    FLAGS.figure_item, FLAGS.top_tokens, time.time() - start)
    common.summary_banner(out, text)


if __name__ == "__main__":
  app.run(main)
