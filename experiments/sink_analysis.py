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
to the uniform share (`dlm_jax.analysis.sinks.relative_scores`: identical to the column sums for a full
bidirectional map; an ARM step's single query row over n written keys is scaled by n), and a key is a
sink when its score exceeds the mean of the others by ε (Eq. 3, ε = 3 by default).

Tasks and prompts: `experiments.common.items`, `experiments.common.prompts`; decoding defaults (they differ from
`experiments.generate`'s official ones) and --padding: `dlm_jax.session.decode_settings`; per-item PRNG keys:
`experiments.common.decoding`. An item's results do not depend on --batch_size or on the items sharing its batch.
run.json records the settings (a resume with other settings is refused); nothing is written before the first
result.

Decoding modes: --decoding=exact|threshold|factor|prefix_cache|dual_cache|threshold_prefix_cache|
threshold_dual_cache with --threshold / --factor (`dlm_jax.session.decoding_mode`; DLMs only). Every measure
reads only the steps a generation decoded at — the first `nfe` steps of the trace, less those its row waited
through while other rows of the batch finished a block (`validity.decoded_steps`) — so its NFE is its own.
Under a KV cache a step's statistics are the incoming attention of the queries the step computed (the
whole sequence at a block's refresh step, then the block and every later position with the prefix cache, the
block alone with the dual cache) over all keys, cached ones included; the query groups split those queries.

Uniform-state models (DiffusionGemma-style, `--samplers=diffusion_gemma`, auto for them): the steps read are
the decoder steps (the encoder calls that commit the prompt and each finished canvas decode no row); a
step's queries are its canvas, its keys the prompt cache, the earlier canvases and the canvas itself (later
positions do not count); the tokens at the canvas's positions are the noisy canvas that step read
(`Trace.canvases`), and the query groups are not-yet-accepted / accepted positions instead of masked /
unmasked (`dlm_jax.instrument.stats.QUERY_GROUP_NAMES`).

Outputs in --output_dir (default results/sink_analysis):
  results.jsonl                one line per (model, prompt): completion, NFE, per-item summaries
  <model>/item_<id>.npz        per-step arrays of the --figure_item generation (its decoded steps: step_index,
                               computed_queries [steps, 2]; head_scores [steps, L', N, S] float16 and
                               head_sinks (the ε-rule's sinks) [steps, L', N, S] bool, canvas
                               [steps, S] the tokens each step read, vocab_ids / vocab_text their strings,
                               and under a decoding rule committed / revoked [steps, S] (the positions each
                               step committed and re-masked); under --policy the policy's text and what each
                               step computed: policy_computed [steps, S], policy_keys_read [steps], and by
                               policy kind policy_keys / policy_layers, policy_notes
                               (`experiments.reports.policy_view`): what `experiments.explore` plays)
  <model>/tracks/item_<id>.npz every item's largest sinks [steps, L', N], tokens, decode_step, valid,
                               step_index, vocab
  <model>/fig_moving_sinks.png the largest sink of the heads whose sinks move most against the step, on the
                               item where they move most, positions named by their tokens
                               (`experiments.reports.figure_axes` gives the rule)
  <model>/fig1_incoming_heatmap.png   incoming attention per key across steps (selected layers, head mean)
  <model>/fig5_main_sink_grid.png     per-(layer, head) main-sink score, averaged over steps and prompts
  <model>/fig7_largest_sink.png       position of the largest sink against the step for chosen heads
  <model>/fig6a_query_groups.png      DLMs: sinks of masked vs unmasked queries (last selected layer)
  <model>/prefill_incoming.png        ARMs: incoming attention over the prompt at the prefill, per layer
  fig3_score_histogram.png, fig10_nonsink_fraction.png   all models
  <model>/fig_routing_sinks.png   mixture-of-experts models: each expert's share of the routing slots of
                               the sink tokens and of the other tokens, per recorded MoE layer
  summary.json, summary.md     Table 2 (most frequent sink tokens), moving-sink measures, first-token
                               sink, separate sinks, non-sink fraction at ε — against the paper's numbers;
                               for MoE models the routing of sinks (below)

Routing of sinks (mixture-of-experts models): the router's choice is recorded at every step
(`StatsSpec.routing`); a token counts as a sink at a step and layer when it is one in at least one head.
Per layer the report gives the Jensen–Shannon divergence (bits) between the expert distribution of the
sinks' routing slots and that of the other tokens, and the experts sinks go to most.
"""

from __future__ import annotations

import collections
import dataclasses
import time
import warnings

import jax
import numpy as np
from absl import flags

from dlm_jax.analysis import routing, sinks
from dlm_jax.runtime import distributed
from dlm_jax.instrument.stats import StatsSpec
from dlm_jax.session import checkpoint_bundle, decode_settings, size_limits
from dlm_jax.session.decode_settings import DecodeSettings
from dlm_jax.session.decoding_mode import DecodingMode
from experiments.common import (analysis_flags, checkpoints, cli, decoding, decoding_flags, devices, flag_checks,
                                item_batches, items, model_runs, numerics, numerics_flags, progress, prompts, run_dir,
                                scoring, validity)
from experiments.reports import sink_report
from experiments.common.items import TaskSettings
from experiments.common.numerics import Numerics
from dlm_jax.instrument import sink_selection
from experiments.reports import explorer_page, policy_view

_CHECKPOINTS = flags.DEFINE_list("checkpoints", ["tiny-dlm", "tiny-moe-dlm", "tiny-uniform-dlm", "tiny-arm"],
                                 f"Checkpoints ([label=]DIR or {', '.join(checkpoints.NAMES)}).")
_HTML = flags.DEFINE_bool("html", False, "Also write the decoding explorer page explorer.html into the output "
                          "directory (`experiments.explore`).")
_N_PROMPTS = flags.DEFINE_integer("n_prompts", 16, "Prompts (generations) per model (0 = the whole task).")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 8, "Prompts per sampler call (results do not depend on it).")
_EPSILON = flags.DEFINE_float("epsilon", 3.0, "ε of the sink rule (Eq. 3), > 0.")
_LAYERS = flags.DEFINE_list("layers", [], "Layers to record (default: all).")
_SPLIT_QUERIES = flags.DEFINE_bool("split_queries", True, "DLMs: also record incoming attention of masked / "
                                   "unmasked queries.")
_TRACK_HEADS = flags.DEFINE_list("track_heads", [], "LAYER:HEAD pairs for Fig. 7 (default: the 3 heads with the "
                                 "largest main-sink score).")
_FIGURE_ITEM = flags.DEFINE_string("figure_item", "0", "Item id whose generation is drawn in the per-generation "
                                   "figures.")
_HISTOGRAM_MAX = flags.DEFINE_float("histogram_max", 50.0, "Upper edge of the score histogram (larger scores go in "
                                    "the last bin).")
_TOP_TOKENS = flags.DEFINE_integer("top_tokens", 8, "Rows of the sink-token table.")

TRACK_ARRAYS = ("largest", "tokens", "decode_step", "valid", "prompt_length", "step_index", "vocab_ids", "vocab_text")
"""The arrays kept for every item (<model>/tracks/item_<id>.npz), from which the moving-sink figure picks its
item (`experiments.reports.figure_axes`)."""
EPSILON_GRID = np.round(np.arange(0.0, 10.01, 0.25), 2)
HIST_BINS = 100


@dataclasses.dataclass(frozen=True)
class Settings:
  """Everything that defines a sink_analysis run (recorded in run.json; flags of the same names)."""

  checkpoints: tuple[str, ...]
  n_prompts: int
  batch_size: int
  epsilon: float
  layers: tuple[int, ...] | None
  split_queries: bool
  track_heads: tuple[str, ...]
  figure_item: str
  histogram_max: float
  top_tokens: int
  task: TaskSettings
  decode: DecodeSettings
  numerics: Numerics
  decoding: DecodingMode = DecodingMode()

  def __post_init__(self):
    flag_checks.checkpoints_given(self.checkpoints)
    flag_checks.item_count(n_prompts=self.n_prompts)
    flag_checks.positive(batch_size=self.batch_size)
    flag_checks.above_zero(epsilon=self.epsilon, histogram_max=self.histogram_max)
    flag_checks.positive(top_tokens=self.top_tokens)
    size_limits.check(n_prompts=self.n_prompts, batch_size=self.batch_size, top_tokens=self.top_tokens)
    flag_checks.layer_indices(self.layers)
    for entry in self.track_heads:
      layer, sep, head = entry.partition(":")
      if not sep or not layer.isdigit() or not head.isdigit():
        raise cli.UserError(f"--track_heads entry {entry!r}: expected LAYER:HEAD with non-negative integers")

  def check_model(self, model: checkpoint_bundle.Model) -> None:
    """Refuses layers and heads the model does not have."""
    config = model.config
    flag_checks.layers_of_model(self.layers, model.label, config.n_layers)
    for entry in self.track_heads:
      layer, _, head = entry.partition(":")
      if int(layer) >= config.n_layers or int(head) >= config.n_heads:
        raise cli.UserError(f"--track_heads entry {entry}: {model.label} has {config.n_layers} layers and "
                            f"{config.n_heads} heads")


def _stats_spec(settings: Settings, model: checkpoint_bundle.Model) -> StatsSpec:
  grouped = model.diffusion and settings.split_queries
  return StatsSpec(incoming_attention=True, per_head=True, layers=settings.layers, query_groups=3 if grouped else 0,
                   routing=model.config.is_moe)


def analyse_row(settings: Settings, model: checkpoint_bundle.Model, item: items.Item, batch: prompts.Prompts, host,
                row: int, layers: list[int], edges: np.ndarray) -> tuple[dict, dict]:
  """Per-item summaries (a JSON-able record) and the per-step arrays kept for the figure item."""
  lp = batch.ids.shape[1]
  tokens, decode_step = host["tokens"][row], host["decode_step"][row]
  decoded = validity.decoded_steps(host["nfe"], host["active_rows"], row)  # the row's steps, [steps]
  incoming = np.asarray(host["incoming"][decoded, :, row], np.float32)  # [steps, L', (3,) N, S]
  queries = np.asarray(host["queries"][decoded])  # [steps, 2]: the computed queries [start, stop)
  grouped = model.diffusion and settings.split_queries
  all_queries = incoming.sum(axis=2) if grouped else incoming  # over the real queries (pads are in no group)
  steps, total = all_queries.shape[0], all_queries.shape[-1]
  valid, active = validity.step_validity(model, batch, row, tokens, steps, queries)
  valid4 = valid[:, None, None, :]
  scores = np.asarray(sinks.relative_scores(all_queries, valid4))  # [steps, L', N, S]
  sink_mask = np.asarray(sink_selection.epsilon_rule(scores, settings.epsilon, "sum", valid4))
  n_entries = int(np.broadcast_to(valid4, scores.shape).sum())
  if model.decoder.self_conditioning:  # the noisy canvas of each decoder step, from the trace
    sequences = sinks.uniform_step_sequences(tokens, host["canvases"][decoded, row], queries)  # [steps, S]
  elif "read" in host:  # a decoding rule: the tokens each step read, revoked drafts included
    read = host["read"][decoded, row]
    sequences = np.concatenate([np.broadcast_to(tokens[:lp], (read.shape[0], lp)), read], axis=1)
  else:
    mask_id = model.config.mask_token_id if model.diffusion else None
    sequences = sinks.step_sequences(tokens[None], decode_step[None], lp, int(host["nfe"]),
                                     mask_id=mask_id)[decoded, 0]  # [steps, S]

  hist, _ = np.histogram(np.minimum(scores[np.broadcast_to(valid4, scores.shape)], edges[-1] - 1e-6), bins=edges)
  nonsink = n_entries - sinks.sink_counts_over_epsilon(scores, EPSILON_GRID, valid4)
  main_score = np.where(valid4, scores, -np.inf).max(-1)[active]  # [active steps, L', N]
  largest = np.asarray(sinks.largest_sink_positions(scores, settings.epsilon, "sum", valid4))  # [steps, L', N]
  counts = sinks.sink_token_counts(sink_mask, sequences[:, None, None, :])
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
  whole = (queries[:, 0] == 0) & (queries[:, 1] == total)  # [steps]: the step computed every query
  record = {
      "model": model.label, "item": item.id, "prompt": item.question,
      "completion": prompts.completion(model, tokens[lp:])[1], "steps": steps, "nfe": steps, "prompt_length": lp,
      "first_real_position": first,
      "score_histogram": hist, "n_entries": n_entries, "nonsink_counts": nonsink,
      "sink_fraction": float(sink_mask.sum() / max(n_entries, 1)),
      "main_sink_grid": main_score.mean(0), "token_counts": dict(token_counts),
      "moving": {k: np.asarray(v, np.float64) for k, v in moving.items()},
      "first_token_share": shares[active].mean(axis=(0, 2)), "active_steps": int(active.sum()),
      "largest_at_first_token": float(((largest == first) & has).sum() / max(has.sum(), 1)),
      "largest_in_prompt": float(((largest < lp) & has).sum() / max(has.sum(), 1)),
      "modal_largest_sink": [_modal_position(largest[active][:, l]) for l in range(len(layers))],
      "whole_canvas_steps": int((whole & active).sum()),
      "modal_largest_sink_whole_canvas": [_modal_position(largest[active & whole][:, l]) for l in range(len(layers))],
  }
  if "experts" in host:  # mixture of experts: the experts chosen for the sink tokens and for the others
    experts = np.asarray(host["experts"][decoded, :, row])  # [steps, L', S, k]
    is_sink = sink_mask.any(axis=2)  # [steps, L', S]: a sink in at least one head
    real = np.broadcast_to(valid[:, None, :], is_sink.shape)
    n_experts = model.config.n_experts
    record["routing"] = {"sink_counts": routing.expert_counts(experts, is_sink & real, n_experts),
                         "nonsink_counts": routing.expert_counts(experts, ~is_sink & real, n_experts)}
  if item.kind != "humaneval":
    record["correct"] = scoring.score(item, record["completion"], model.prompt_format == "chat")["correct"]
  seen = np.unique(np.concatenate([tokens.ravel(), sequences[sequences >= 0].ravel()]))
  arrays = {"layer_scores": scores.mean(2), "largest": largest, "tokens": tokens, "decode_step": decode_step,
            "valid": valid, "layers": np.asarray(layers), "prompt_length": np.asarray(lp),
            "step_index": decoded, "computed_queries": queries,
            "head_scores": scores.astype(np.float16), "head_sinks": sink_mask, "canvas": sequences.astype(np.int32),
            "vocab_ids": seen.astype(np.int32),
            **{name: np.pad(host[name][decoded, row], ((0, 0), (lp, 0))) for name in ("committed", "revoked")
               if name in host},
            "vocab_text": np.asarray([model.tokenizer.id_to_token(int(i)) or "?" for i in seen], dtype=str)}
  if "computed" in host:  # a compute policy: what each step computed (`experiments.reports.policy_view`)
    policy = decoding.sink_token_kept(model, settings.decoding.compute_policy())
    at_row = lambda x: np.asarray(x)[decoded, row]
    arrays.update(policy_view.step_view(policy, policy_view.RowTrace(
        at_row(host["computed"]), at_row(host["keys_read"]),
        None if host["policy_record"] is None else jax.tree.map(at_row, host["policy_record"]),
        model.config.n_layers), layers))
  if grouped:
    masked_q = incoming[:, :, 0]
    unmasked_q = incoming[:, :, 1] + incoming[:, :, 2]
    positions = np.arange(total)[None, :]
    computed = (positions >= queries[:, :1]) & (positions < queries[:, 1:])  # [steps, S]
    n_masked, n_computed = (_masked_queries(model, sequences, host, decoded, row) & computed).sum(-1), computed.sum(-1)
    both = (n_masked > 0) & (n_masked < n_computed)  # the step's queries hold both groups
    both_groups = np.broadcast_to(both[:, None], (steps, masked_q.shape[2]))
    masked_keys, unmasked_keys = np.where(valid4, masked_q, -1.0), np.where(valid4, unmasked_q, -1.0)
    separate = [sinks.main_sink_disagreement(masked_keys[:, l], unmasked_keys[:, l], both_groups)
                for l in range(len(layers))]
    record["separate_sinks"] = [d / c if c else float("nan") for d, c in separate]
    arrays["group_incoming"] = np.stack([masked_q.mean(2), unmasked_q.mean(2)], axis=2)  # [steps, L', 2, S]
  return record, arrays


def run_model(settings: Settings, model: checkpoint_bundle.Model, runtime: devices.Runtime,
              log: run_dir.ResultsLog) -> dict:
  """Generates and analyses the model's prompts not done yet; returns its metadata for the report."""
  config = model.config
  spec = _stats_spec(settings, model)
  layers = list(spec.layers) if spec.layers is not None else list(range(config.n_layers))
  task = items.task_name(settings.task.task, model.record)
  todo = items.load_items(task, settings.n_prompts, settings.task.data_seed)
  prompt_set = prompts.encode(model, todo)
  values = decode_settings.model_settings(settings.decode, model, settings.decoding)
  edges = edges_of(settings)
  done = lambda item: log.done(model=model.label, item=item.id)
  meter = progress.Progress(f"{model.label} prompts", len(todo), sum(map(done, todo)))
  for batch in item_batches.batches(todo, prompt_set, settings.batch_size, settings.decode.seed, runtime,
                                    done):
    start = time.time()
    trace = decoding.generate(model, values, batch.prompts, runtime, settings.numerics, key=batch.key,
                              stats_spec=spec)
    host = distributed.to_host({"tokens": trace.tokens, "decode_step": trace.decode_step, "nfe": trace.nfe,
                                "active_rows": trace.active_rows, "queries": trace.computed_queries,
                                "incoming": trace.stats["incoming_attention"],
                                **({"experts": trace.stats["routed_experts"]} if config.is_moe else {}),
                                **({"accepted": trace.accepted, "canvases": trace.canvases}
                                   if model.decoder.self_conditioning else {}),
                                **({"read": trace.canvases, "committed": trace.committed, "revoked": trace.revoked}
                                   if trace.revoked is not None else {}),
                                **({"computed": trace.computed_positions, "keys_read": trace.keys_read,
                                    "policy_record": trace.policy_record}
                                   if trace.computed_positions is not None else {})})
    for row, item in enumerate(batch.items):
      if done(item):
        continue
      record, arrays = analyse_row(settings, model, item, batch.prompts, host, row, layers, edges)
      if item.id == settings.figure_item:
        log.run_dir.write_npz(f"{model.label}/item_{item.id}.npz", **arrays)
      log.run_dir.write_npz(f"{model.label}/tracks/item_{item.id}.npz",
                            **{k: arrays[k] for k in TRACK_ARRAYS})
      log.append(record)
      meter.update(1, f"{time.time() - start:.1f}s for the batch")
  return {"label": model.label, "directory": progress.display_path(model.directory), "sampler": model.sampler,
          "layers": layers, "n_heads": config.n_heads, "diffusion": model.diffusion, "task": task,
          "prompt_format": model.prompt_format, "settings": values, "block_length": values.get("block_length")}


def main(argv):
  del argv
  shared = analysis_flags.from_flags("sink_analysis", _CHECKPOINTS)
  mode = decoding_flags.from_flags()
  models = shared.prepare_models()
  runtime = devices.init_runtime(shared.runtime)
  settings = Settings(checkpoints=shared.checkpoints, n_prompts=_N_PROMPTS.value, batch_size=_BATCH_SIZE.value,
                      epsilon=_EPSILON.value, layers=cli.int_list(_LAYERS.value, "layers") or None,
                      split_queries=_SPLIT_QUERIES.value, track_heads=tuple(_TRACK_HEADS.value),
                      figure_item=_FIGURE_ITEM.value, histogram_max=_HISTOGRAM_MAX.value, top_tokens=_TOP_TOKENS.value,
                      task=shared.task, decode=shared.decode, numerics=numerics_flags.from_flags(shared.runtime),
                      decoding=mode)
  for model in models:
    settings.check_model(model)
    decode_settings.model_settings(shared.decode, model, mode)
    decoding.warn_if_unused(mode, model.sampler, model.label)
  runs = model_runs.run_models(shared.output, settings, models, runtime, shared.task.task, run_model)
  if runs is not None:
    text = sink_report.write_report(runs.out.path, runs.metas, runs.log.records, EPSILON_GRID, settings.epsilon,
                                    edges_of(settings), list(settings.track_heads), settings.figure_item,
                                    settings.top_tokens, runs.seconds)
    if _HTML.value:
      explorer_page.write_page(runs.out.path, runs.out.file(explorer_page.PAGE_FILE))
    progress.summary_banner(runs.out.path, text)


def _masked_queries(model: checkpoint_bundle.Model, sequences: np.ndarray, host, decoded: np.ndarray,
                    row: int) -> np.ndarray:
  """[steps, S] bool: the positions of the "masked" query group at each decoded step — the mask token, or for
  DiffusionGemma the canvas positions the previous call did not accept (`dlm_jax.instrument.stats.QUERY_GROUP_NAMES`;
  a canvas's first decoder step follows its encoder call, which accepts nothing)."""
  if not model.decoder.self_conditioning:
    return sequences == model.config.mask_token_id
  accepted = np.asarray(host["accepted"])[decoded - 1, row]  # [steps, C]: the previous call's
  queries = np.asarray(host["queries"])[decoded]
  out = np.zeros(sequences.shape, bool)
  for t, (start, stop) in enumerate(queries):
    out[t, start:stop] = ~accepted[t]
  return out


def _modal_position(largest: np.ndarray) -> int:
  """The most frequent largest-sink position of largest [steps, N] (−1 = none; ties: the lower position)."""
  found = largest[largest >= 0]
  return int(np.bincount(found).argmax()) if found.size else -1


def edges_of(settings: Settings) -> np.ndarray:
  """The score histogram's bin edges."""
  return np.linspace(0.0, settings.histogram_max, HIST_BINS + 1)


if __name__ == "__main__":
  cli.run(main)
