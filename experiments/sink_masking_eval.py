r"""Accuracy with the previous step's top-K attention sinks masked (Rulli et al., paper A Table 1).

  python -m experiments.sink_masking_eval                         # embedded tiny DLM and ARM, synthetic task
  python -m experiments.sink_masking_eval --checkpoints=smollm2   # SmolLM2: greedy accuracy + perplexity
  python -m experiments.sink_masking_eval --checkpoints=llada=/ckpt/llada-8b-instruct,llama=/ckpt/llama3-8b \
      --task=gsm8k_test.jsonl --n_items=0 --gen_length=256 --steps=256 --block_length=32 --batch_size=16 \
      --dtype=bfloat16 --mesh=data:8

Conditions: K in --mask_top_k (default 0, 1, 5, 10); K = 0 is the unmasked baseline. DLMs decode with their
sampler under `MaskPreviousSinks`: at every step but the first, the K keys with the most incoming
attention at the previous step are removed (MASK_VALUE bias) — per (layer, head) by default
(--mask_scope=global: ranked by the layer/head mean and removed everywhere), optionally only among keys
passing the ε-rule (--sink_epsilon). ARMs decode greedily under `MaskPreviousSinksAR`: the K keys of the
previous iteration's last query row (--ar_last_row; otherwise that call's column sums). K is state
(`MaskPreviousSinks.with_top_k`), so one compiled program serves every condition; every condition of a
batch uses the same PRNG key.

For causal models it also reports teacher-forced perplexity (`experiments.perplexity`) of a text set
(--perplexity_text; default: the synthetic test problems for a model trained on them, else
experiments/data/paragraphs.txt) with no masking, the first token masked, and the top-K static sinks
masked.

Items are spread over the mesh's batch axes (data × fsdp) in fixed batches (the last padded), and every
finished (model, condition, item) is one line of results.jsonl, so an interrupted run resumes exactly
(--max_items_this_run stops early on purpose). Standard errors are binomial: sqrt(p(1 − p)/n).

Outputs in --output_dir (default results/sink_masking_eval): results.jsonl, table.md, table.json,
masking_accuracy.png, summary.md (tables set against the paper's Table 1).
"""

from __future__ import annotations

import os
import time

import jax
import numpy as np
from absl import app, flags, logging

from dlm_jax import distributed, interventions
from experiments import common, devices, masking_report, workload

FLAGS = flags.FLAGS
flags.DEFINE_list("checkpoints", ["tiny-dlm", "tiny-arm"], "Checkpoints ([label=]DIR or tiny-dlm, tiny-arm, smollm2).")
flags.DEFINE_list("mask_top_k", ["0", "1", "5", "10"], "Numbers K of sinks to mask (0 = unmasked baseline).")
flags.DEFINE_integer("n_items", 64, "Items per model (0 = the whole task).")
flags.DEFINE_integer("batch_size", 16, "Items per sampler call (rounded up to a multiple of the batch shards).")
flags.DEFINE_enum("mask_scope", "head", ["head", "global"], "Sinks chosen and masked per (layer, head) or globally.")
flags.DEFINE_float("sink_epsilon", None, "Only mask keys passing the ε-rule (default: the top-K regardless).")
flags.DEFINE_bool("ar_last_row", True, "ARMs: choose the sinks from the previous call's last query row.")
flags.DEFINE_bool("perplexity", True, "Causal models: also measure perplexity under masking.")
flags.DEFINE_string("perplexity_text", None, "Text file (paragraphs separated by blank lines) for perplexity.")
flags.DEFINE_integer("perplexity_items", 32, "Synthetic problems scored for perplexity (synthetic-trained models).")

PAPER_TABLE1 = {
    "GSM8K": {"Dream-7B": ["0.82±0.01", "0.79±0.01", "0.78±0.01", "0.75±0.01"],
              "LLaDA-8B": ["0.76±0.01", "0.75±0.01", "0.73±0.01", "0.55±0.01"],
              "MMaDA-8B": ["0.54±0.01", "0.53±0.01", "0.54±0.01", "0.37±0.01"],
              "LLaMA-3.1-8B": ["0.85±0.01", "0.02±0.00", "0.02±0.00", "0.01±0.03"]},
    "HumanEval": {"Dream-7B": ["0.60±0.03", "0.64±0.03", "0.61±0.03", "0.57±0.03"],
                  "LLaDA-8B": ["0.37±0.03", "0.37±0.03", "0.39±0.03", "0.35±0.03"],
                  "MMaDA-8B": ["0.16±0.02", "0.16±0.03", "0.18±0.03", "0.09±0.02"],
                  "LLaMA-3.1-8B": ["0.66±0.04", "0.00±0.00", "0.00±0.00", "0.00±0.00"]},
}


def _top_ks() -> list[int]:
  try:
    ks = [int(k) for k in FLAGS.mask_top_k]
  except ValueError:
    raise app.UsageError(f"--mask_top_k must be integers, got {FLAGS.mask_top_k}.") from None
  if not ks or any(k < 0 for k in ks) or len(set(ks)) != len(ks):
    raise app.UsageError(f"--mask_top_k must be distinct integers >= 0, got {FLAGS.mask_top_k}.")
  return ks


def _masker(model: workload.Model):
  per_head = FLAGS.mask_scope == "head"
  if model.diffusion:
    return interventions.MaskPreviousSinks(top_k=1, per_head=per_head, epsilon=FLAGS.sink_epsilon)
  return interventions.MaskPreviousSinksAR(top_k=1, per_head=per_head, last_row_weights=FLAGS.ar_last_row)


def _state(model, intervention, masker, batch: int, total: int, k: int, valid: np.ndarray):
  """Initial intervention state with K = k and the valid keys eligible."""
  state = intervention.init_state(model.config, batch, total)

  def set_k(s):
    return masker.with_top_k(s, k).replace(eligible=jax.numpy.asarray(valid))

  if isinstance(intervention, interventions.Compose):
    return (state[0], set_k(state[1]))
  return set_k(state)


def run_accuracy(model, runtime, log, ks) -> int:
  """Runs every (batch, K) not finished yet; returns the number of items."""
  items = workload.load_items(workload.task_name(model), FLAGS.n_items)
  batch = runtime.round_batch(FLAGS.batch_size)
  masker = _masker(model)
  intervention = workload.combined_intervention(model, masker)
  chat = model.prompt_format == "chat"
  units = [(index, rows, k) for index, rows in enumerate(common.fixed_batches(len(items), batch)) for k in ks]
  done = sum(log.done(kind="accuracy", model=model.label, condition=k, item=it.id) for it in items for k in ks)
  progress = common.Progress(f"{model.label} items×conditions", len(items) * len(ks), done)
  for index, rows, k in units:
    chunk = [items[i] for i in rows]
    if all(log.done(kind="accuracy", model=model.label, condition=k, item=it.id) for it in chunk):
      continue
    prompts = workload.encode_prompts(model, chunk)
    ids = common.pad_rows(prompts.ids, batch)
    mask = None if prompts.mask is None else common.pad_rows(prompts.mask, batch)
    padded = workload.Prompts(ids, mask, prompts.rows)
    length = workload.gen_length(model)
    total = ids.shape[1] + length
    valid = np.ones((batch, total), bool)
    if mask is not None:
      valid[:, :ids.shape[1]] = mask
    state = _state(model, intervention, masker, batch, total, k, valid)
    start = time.time()
    trace = workload.generate(model, padded, runtime, key=jax.random.fold_in(jax.random.key(FLAGS.seed), index),
                              intervention=intervention, intervention_state=state)
    generated = distributed.to_host(trace.generated)
    for row, item in enumerate(chunk):
      completion_ids, text = workload.completion(model, generated[row])
      result = workload.score(item, text, chat)
      log.append({"kind": "accuracy", "model": model.label, "condition": k, "item": item.id,
                  "prompt_ids": prompts.rows[row], "completion_ids": completion_ids, "completion": text, **result})
    progress.update(len(chunk), f"K={k}, {time.time() - start:.1f}s")
  return len(items)


def _perplexity_texts(model) -> list[list[int]]:
  """Token rows to score: synthetic test problems in the AR training layout for models trained on the
  synthetic task, else the paragraphs of --perplexity_text (default experiments/data/paragraphs.txt)."""
  tok, config = model.tokenizer, model.config
  bos = [] if config.bos_token_id is None else [config.bos_token_id]
  if FLAGS.perplexity_text is None and model.record.get("data", {}).get("data") == "synthetic":
    from dlm_jax.tasks import synthetic  # pylint: disable=import-outside-toplevel
    problems = synthetic.make_split("test", FLAGS.perplexity_items, FLAGS.data_seed + 1)
    return [bos + tok.encode(p.question) + tok.encode(p.answer) + [config.eos_token_id] for p in problems]
  path = FLAGS.perplexity_text or os.path.join(workload.DATA_DIR, "paragraphs.txt")
  with open(path, encoding="utf-8") as f:
    paragraphs = [p.strip() for p in f.read().split("\n\n") if p.strip()]
  return [bos + tok.encode(p) for p in paragraphs]


def run_perplexity(model, runtime, log, ks) -> None:
  from experiments import perplexity  # pylint: disable=import-outside-toplevel
  names = perplexity.condition_names(ks)
  texts = _perplexity_texts(model)
  if all(log.done(kind="perplexity", model=model.label, condition=c, item=str(i)) for c in names
         for i in range(len(texts))):
    return
  width = max(len(t) for t in texts)
  tokens = np.full((len(texts), width), model.config.pad_token_id or 0, np.int32)
  real = np.zeros((len(texts), width), bool)
  for i, row in enumerate(texts):
    tokens[i, :len(row)], real[i, :len(row)] = row, True
  batch = runtime.round_batch(FLAGS.batch_size)
  for rows in common.fixed_batches(len(texts), batch):
    if all(log.done(kind="perplexity", model=model.label, condition=c, item=str(i)) for c in names for i in rows):
      continue
    start = time.time()
    toks = devices.place_batch(common.pad_rows(tokens[rows], batch), runtime)
    reals = devices.place_batch(common.pad_rows(real[rows], batch), runtime)
    nll = distributed.to_host(perplexity.perplexity_conditions(model.params, toks, reals, ks, config=model.config,
                                                          attention_impl=FLAGS.attention_impl))
    for name in names:
      for row, i in enumerate(rows):
        log.append({"kind": "perplexity", "model": model.label, "condition": name, "item": str(i),
                    "nll": float(nll[name][row]), "n_tokens": int(real[i].sum() - 1)})
    logging.info("%s perplexity: texts %d-%d in %.1fs", model.label, rows[0], rows[-1], time.time() - start)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  ks = _top_ks()
  runtime = devices.init_runtime()
  out = common.output_dir("sink_masking_eval")
  entries = FLAGS.checkpoints
  samplers = workload.samplers_for(entries)
  settings = {name: FLAGS[name].value for name in (
      "checkpoints", "samplers", "mask_top_k", "n_items", "batch_size", "mask_scope", "sink_epsilon", "ar_last_row",
      "perplexity", "perplexity_text", "perplexity_items", "task", "data_seed", "prompt_format", "gen_length",
      "steps", "block_length", "temperature", "cfg_scale", "remasking", "alg", "alg_temp", "top_p", "top_k",
      "seed")}
  common.prepare_output_dir(out, runtime, settings)
  log = common.ResultsLog(os.path.join(out, "results.jsonl"), ("kind", "model", "condition", "item"), runtime.primary)
  metas, stopped, start = [], False, time.time()
  try:
    for entry, sampler in zip(entries, samplers):
      model = workload.load_model(entry, sampler, runtime)
      n_items = run_accuracy(model, runtime, log, ks)
      if FLAGS.perplexity and not model.diffusion:
        run_perplexity(model, runtime, log, ks)
      metas.append({"label": model.label, "directory": common.display_path(model.directory), "task": workload.task_name(model),
                    "prompt_format": model.prompt_format, "n_items": n_items, "diffusion": model.diffusion,
                    "settings": workload.sampler_settings(model)})
  except common.ItemBudget as stop:
    logging.info("%s", stop)
    stopped = True
  if runtime.primary and not stopped:
    text = masking_report.write_report(out, metas, log.records, ks, PAPER_TABLE1, time.time() - start)
    common.summary_banner(out, text)


if __name__ == "__main__":
  app.run(main)
