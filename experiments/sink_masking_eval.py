r"""Accuracy with the previous step's top-K attention sinks masked (Rulli et al., paper A Table 1).

  python -m experiments.sink_masking_eval                         # embedded tiny DLM and ARM, synthetic task
  python -m experiments.sink_masking_eval --checkpoints=smollm2   # SmolLM2: greedy accuracy + perplexity
  python -m experiments.sink_masking_eval --checkpoints=llada=/ckpt/llada-8b-instruct,llama=/ckpt/llama3-8b \
      --task=gsm8k_test.jsonl --n_items=0 --gen_length=256 --steps=256 --block_length=32 --batch_size=16 \
      --dtype=bfloat16 --mesh=data:8

Conditions: K in --mask_top_k (default 0, 1, 5, 10); K = 0 is the unmasked baseline. DLMs decode with their
sampler (uniform-state models with the DiffusionGemma sampler, whose previous step is the previous model
call, encoder commits included) under `MaskPreviousSinks`: at every step but the first, the K keys with the most incoming
attention at the previous step are removed (MASK_VALUE bias) — per (layer, head) by default
(--mask_scope=global: ranked by the layer/head mean and removed everywhere), optionally only among keys
passing the ε-rule (--sink_epsilon). ARMs decode greedily under `MaskPreviousSinksAR`: the K keys of the
previous iteration's last query row (--ar_last_row; otherwise that call's column sums). K is state
(`MaskPreviousSinks.with_top_k`), so one compiled program serves every condition; every condition of a
batch uses the same PRNG key.

For causal models it also reports teacher-forced perplexity (`dlm_jax.analysis.perplexity`) of a text set
(--perplexity_text; default: the synthetic test problems for a model trained on them, else
experiments/data/paragraphs.txt) with no masking, the first token masked, and the top-K static sinks
masked.

Decoding modes: --decoding=exact|threshold|factor|prefix_cache|dual_cache|threshold_prefix_cache|
threshold_dual_cache with --threshold / --factor (`dlm_jax.session.decoding_mode`; DLMs only). Under a KV cache
the sinks of a step come from the incoming attention of the queries it computed (the whole sequence at a
block's refresh step, then the block and every later position with the prefix cache, the block alone with
the dual cache) over all keys, cached ones included. With a threshold or factor rule the rows of a batch
wait for each other block by block; a waiting row keeps its tokens, key and masker state
(`Intervention.keep_rows`), so every item's result is its own whatever its batch. Every record holds the
item's NFE.

Items are spread over the mesh's batch axes (data × fsdp) in fixed batches (the last padded), and every
finished (model, condition, item) is one line of results.jsonl, so an interrupted run resumes exactly
(--max_items_this_run stops early on purpose). Standard errors are binomial: sqrt(p(1 − p)/n).

Tasks and prompts: `experiments.common.items`, `experiments.common.prompts`; decoding defaults (they differ from
`experiments.generate`'s official ones) and --padding: `dlm_jax.session.decode_settings`; per-item PRNG keys:
`experiments.common.decoding`. An item's results do not depend on --batch_size or on the items sharing its batch.
run.json records the settings (a resume with other settings is refused); nothing is written before the first
result.

Outputs in --output_dir (default results/sink_masking_eval): results.jsonl, table.md, table.json,
masking_accuracy.png, summary.md (tables set against the paper's Table 1).
"""

from __future__ import annotations

import dataclasses
import os
import time

import numpy as np
from absl import flags, logging

from dlm_jax.instrument import interventions
from dlm_jax.runtime import distributed
from dlm_jax.session import checkpoint_bundle, decode_settings, size_limits
from dlm_jax.session.decode_settings import DecodeSettings
from dlm_jax.session.decoding_mode import DecodingMode
from experiments.common import (analysis_flags, checkpoints, cli, decoding, decoding_flags, devices, flag_checks,
                                item_batches, items, model_runs, numerics, numerics_flags, progress, prompts, scoring)
from experiments.reports import masking_report
from experiments.common.items import TaskSettings
from experiments.common.numerics import Numerics
from experiments.reports import explorer_page

_CHECKPOINTS = flags.DEFINE_list("checkpoints", ["tiny-dlm", "tiny-moe-dlm", "tiny-uniform-dlm", "tiny-arm"],
                                 "Checkpoints ([label=]DIR or tiny-dlm, tiny-moe-dlm, tiny-uniform-dlm, tiny-arm, "
                                 "smollm2).")
_MASK_TOP_K = flags.DEFINE_list("mask_top_k", ["0", "1", "5", "10"], "Numbers K >= 0 of sinks to mask (0 = "
                                "unmasked baseline), distinct.")
_HTML = flags.DEFINE_bool("html", False, "Also write the decoding explorer page explorer.html into the output "
                          "directory (`experiments.explore`).")
_N_ITEMS = flags.DEFINE_integer("n_items", 64, "Items per model (0 = the whole task).")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 16, "Items per sampler call (results do not depend on it).")
_MASK_SCOPE = flags.DEFINE_enum("mask_scope", "head", ["head", "global"], "Sinks chosen and masked per (layer, "
                                "head) or globally.")
_SINK_EPSILON = flags.DEFINE_float("sink_epsilon", None, "Only mask keys passing the ε-rule (> 0; default: the "
                                   "top-K regardless).")
_AR_LAST_ROW = flags.DEFINE_bool("ar_last_row", True, "ARMs: choose the sinks from the previous call's last query "
                                 "row.")
_PERPLEXITY = flags.DEFINE_bool("perplexity", True, "Causal models: also measure perplexity under masking.")
_PERPLEXITY_TEXT = flags.DEFINE_string("perplexity_text", None, "Text file (paragraphs separated by blank lines) "
                                       "for perplexity.")
_PERPLEXITY_ITEMS = flags.DEFINE_integer("perplexity_items", 32, "Synthetic problems scored for perplexity "
                                         "(synthetic-trained models), >= 1.")

RESULT_KEYS = ("kind", "model", "condition", "item")
"""What names a line of results.jsonl: accuracy lines per item and K, perplexity lines per text and condition."""
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


@dataclasses.dataclass(frozen=True)
class Settings:
  """Everything that defines a sink_masking_eval run (recorded in run.json; flags of the same names)."""

  checkpoints: tuple[str, ...]
  mask_top_k: tuple[int, ...]
  n_items: int
  batch_size: int
  mask_scope: str
  sink_epsilon: float | None
  ar_last_row: bool
  perplexity: bool
  perplexity_text: str | None
  perplexity_items: int
  task: TaskSettings
  decode: DecodeSettings
  numerics: Numerics
  decoding: DecodingMode = DecodingMode()

  def __post_init__(self):
    flag_checks.checkpoints_given(self.checkpoints)
    ks = self.mask_top_k
    if not ks or any(k < 0 for k in ks) or len(set(ks)) != len(ks):
      raise cli.UserError(f"--mask_top_k={','.join(map(str, ks))}: expected distinct integers >= 0")
    flag_checks.item_count(n_items=self.n_items)
    flag_checks.positive(batch_size=self.batch_size)
    if self.sink_epsilon is not None and self.sink_epsilon <= 0:
      raise cli.UserError(f"--sink_epsilon={self.sink_epsilon}: expected > 0 (or leave it unset)")
    flag_checks.positive(perplexity_items=self.perplexity_items)
    size_limits.check(n_items=self.n_items, batch_size=self.batch_size, perplexity_items=self.perplexity_items)
    if self.perplexity_text is not None and not os.path.isfile(self.perplexity_text):
      raise cli.UserError(f"--perplexity_text={self.perplexity_text}: no such file")


def _masker(settings: Settings, model: checkpoint_bundle.Model):
  per_head = settings.mask_scope == "head"
  if model.diffusion:
    return interventions.MaskPreviousSinks(top_k=1, per_head=per_head, epsilon=settings.sink_epsilon)
  return interventions.MaskPreviousSinksAR(top_k=1, per_head=per_head, last_row_weights=settings.ar_last_row)


def run_accuracy(settings: Settings, model, runtime, log) -> int:
  """Runs every (batch, K) not finished yet; returns the number of items."""
  todo = items.load_items(items.task_name(settings.task.task, model.record), settings.n_items,
                          settings.task.data_seed)
  prompt_set = prompts.encode(model, todo)
  values = decode_settings.model_settings(settings.decode, model, settings.decoding)
  masker = _masker(settings, model)
  intervention = decoding.combined_intervention(model, masker)
  chat = model.prompt_format == "chat"
  ks = settings.mask_top_k
  done_k = lambda item, k: log.done(kind="accuracy", model=model.label, condition=k, item=item.id)
  done = lambda item: all(done_k(item, k) for k in ks)
  meter = progress.Progress(f"{model.label} items×conditions", len(todo) * len(ks),
                            sum(done_k(it, k) for it in todo for k in ks))
  for batch in item_batches.batches(todo, prompt_set, settings.batch_size, settings.decode.seed, runtime, done):
    ids, mask = batch.prompts.ids, batch.prompts.mask
    total = ids.shape[1] + values["gen_length"]
    valid = np.ones((ids.shape[0], total), bool)
    if mask is not None:
      valid[:, :ids.shape[1]] = mask
    for k in ks:
      if all(done_k(item, k) for item in batch.items):
        continue
      state = decoding.masker_state(model, intervention, masker, ids.shape[0], total, k, valid)
      start = time.time()
      trace = decoding.generate(model, values, batch.prompts, runtime, settings.numerics, key=batch.key,
                                intervention=intervention, intervention_state=state)
      generated, row_nfe = distributed.to_host((trace.generated, trace.row_nfe))
      written = 0
      for row, item in enumerate(batch.items):
        completion_ids, text = prompts.completion(model, generated[row])
        result = scoring.score(item, text, chat)
        written += log.append({"kind": "accuracy", "model": model.label, "condition": k, "item": item.id,
                               "prompt_ids": batch.prompts.rows[row], "completion_ids": completion_ids,
                               "completion": text, "nfe": int(row_nfe[row]), **result})
      meter.update(written, f"K={k}, {time.time() - start:.1f}s")
  return len(todo)


def _perplexity_texts(settings: Settings, model) -> list[list[int]]:
  """Token rows to score: synthetic test problems in the AR training layout for models trained on the
  synthetic task, else the paragraphs of --perplexity_text (default experiments/data/paragraphs.txt)."""
  tok, config = model.tokenizer, model.config
  bos = [] if config.bos_token_id is None else [config.bos_token_id]
  if settings.perplexity_text is None and model.record.get("data", {}).get("data") == "synthetic":
    from dlm_jax.tasks import synthetic  # pylint: disable=import-outside-toplevel
    problems = synthetic.make_split("test", settings.perplexity_items, settings.task.data_seed + 1)
    return [bos + tok.encode(p.question) + tok.encode(p.answer) + [config.eos_token_id] for p in problems]
  path = settings.perplexity_text or os.path.join(items.DATA_DIR, "paragraphs.txt")
  with open(path, encoding="utf-8") as f:
    paragraphs = [p.strip() for p in f.read().split("\n\n") if p.strip()]
  if not paragraphs:
    raise cli.UserError(f"--perplexity_text={path} holds no text")
  return [bos + tok.encode(p) for p in paragraphs]


def run_perplexity(settings: Settings, model, runtime, log) -> None:
  """Teacher-forced perplexity of every text under every condition not finished yet."""
  from dlm_jax.analysis import perplexity  # pylint: disable=import-outside-toplevel
  ks = list(settings.mask_top_k)
  names = perplexity.condition_names(ks)
  texts = _perplexity_texts(settings, model)
  done = lambda i: all(log.done(kind="perplexity", model=model.label, condition=c, item=str(i)) for c in names)
  width = max(len(t) for t in texts)
  tokens = np.full((len(texts), width), model.config.pad_token_id or 0, np.int32)
  real = np.zeros((len(texts), width), bool)
  for i, row in enumerate(texts):
    tokens[i, :len(row)], real[i, :len(row)] = row, True
  rows_per_call = runtime.round_batch(settings.batch_size)
  for rows in item_batches.fixed_batches(len(texts), settings.batch_size):
    if all(done(i) for i in rows):
      continue
    start = time.time()
    toks = devices.place_batch(item_batches.pad_rows(tokens[rows], rows_per_call), runtime)
    reals = devices.place_batch(item_batches.pad_rows(real[rows], rows_per_call), runtime)
    nll = distributed.to_host(perplexity.perplexity_conditions(model.params, toks, reals, ks, config=model.config,
                                                               attention_impl=settings.numerics.attention_impl))
    for name in names:
      for row, i in enumerate(rows):
        log.append({"kind": "perplexity", "model": model.label, "condition": name, "item": str(i),
                    "nll": float(nll[name][row]), "n_tokens": int(real[i].sum() - 1)})
    logging.info("%s perplexity: texts %d-%d in %.1fs", model.label, rows[0], rows[-1], time.time() - start)


def run_model(settings: Settings, model, runtime, log) -> dict:
  """Runs the model's accuracy conditions and, for a causal model, its perplexity, each as far as not done
  yet; returns its metadata for the report."""
  n_items = run_accuracy(settings, model, runtime, log)
  if settings.perplexity and not model.diffusion:
    run_perplexity(settings, model, runtime, log)
  return {"label": model.label, "directory": progress.display_path(model.directory),
          "task": items.task_name(settings.task.task, model.record), "prompt_format": model.prompt_format,
          "n_items": n_items, "diffusion": model.diffusion,
          "settings": decode_settings.model_settings(settings.decode, model, settings.decoding)}


def main(argv):
  del argv
  shared = analysis_flags.from_flags("sink_masking_eval", _CHECKPOINTS)
  mode = decoding_flags.from_flags()
  ks = cli.int_list(_MASK_TOP_K.value, "mask_top_k")
  models = shared.prepare_models()
  runtime = devices.init_runtime(shared.runtime)
  settings = Settings(checkpoints=shared.checkpoints, mask_top_k=ks, n_items=_N_ITEMS.value,
                      batch_size=_BATCH_SIZE.value, mask_scope=_MASK_SCOPE.value, sink_epsilon=_SINK_EPSILON.value,
                      ar_last_row=_AR_LAST_ROW.value, perplexity=_PERPLEXITY.value,
                      perplexity_text=_PERPLEXITY_TEXT.value, perplexity_items=_PERPLEXITY_ITEMS.value,
                      task=shared.task, decode=shared.decode, numerics=numerics_flags.from_flags(shared.runtime),
                      decoding=mode)
  for model in models:
    decode_settings.model_settings(shared.decode, model, mode)
    decoding.warn_if_unused(mode, model.sampler, model.label)
  runs = model_runs.run_models(shared.output, settings, models, runtime, shared.task.task, run_model, RESULT_KEYS)
  if runs is not None:
    text = masking_report.write_report(runs.out.path, runs.metas, runs.log.records, list(ks), PAPER_TABLE1,
                                       runs.seconds)
    if _HTML.value:
      explorer_page.write_page(runs.out.path, runs.out.file(explorer_page.PAGE_FILE))
    progress.summary_banner(runs.out.path, text)


if __name__ == "__main__":
  cli.run(main)
