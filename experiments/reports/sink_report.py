"""Figures, summary.json and summary.md of `experiments.sink_analysis`, rebuilt from its results.jsonl
(and the figure item's .npz) so that an interrupted and resumed run reports exactly what an uninterrupted
one does."""

from __future__ import annotations

import collections
import os
import warnings

import numpy as np

from dlm_jax.analysis import routing
from dlm_jax.sampling import registry
from dlm_jax.session.decoding_mode import MODES
from experiments.reports import figure_axes
from experiments.common import atomic_files
from experiments.reports import plots, summary_files

PAPER_TABLE2 = {
    "LLaDA-8B": [("Ċ", 0.368), ("<|mdm_mask|>", 0.366), (".", 0.050), ("<|start_header_id|>", 0.008),
                 ("(white-space)", 0.008)],
    "Dream-7B": [("<|mask|>", 0.321), ("Ċ", 0.090), (".", 0.046), (",", 0.044), ("<|endoftext|>", 0.040)],
    "MMaDA-8B": [("Ċ", 0.180), ("<|mdm_mask|>", 0.166), ("<|end_header_id|>", 0.160), ("<|startoftext|>", 0.108),
                 ("istant", 0.066)],
}
CACHE_NOTE = ("With a KV cache (--decoding=prefix_cache, dual_cache, ...) a step's statistics are the incoming "
              "attention of the queries that step computed — the whole sequence at a block's first (refresh) step, "
              "then the block and every later position (prefix cache) or the block alone (dual cache) — over all "
              "keys, cached keys included; the scores stay relative to the uniform share of those queries.")
MOVING_KEYS = ("sinks_per_head", "steps_with_sink", "change_rate", "drift", "signed_drift", "mean_lifetime",
               "centroid_variance")


def _nanmean(rows, axis=0):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", RuntimeWarning)
    return np.nanmean(np.asarray(rows, np.float64), axis=axis)


def aggregate(records: list[dict], epsilon_grid: np.ndarray, epsilon: float) -> dict:
  """Model-level aggregates of the per-item records of one model."""
  n_entries = np.asarray([r["n_entries"] for r in records], np.float64)
  nonsink = np.sum([r["nonsink_counts"] for r in records], axis=0) / max(n_entries.sum(), 1)
  tokens = collections.Counter()
  for r in records:
    tokens.update(r["token_counts"])
  total = sum(tokens.values())
  correct = [r["correct"] for r in records if "correct" in r]
  agg = {
      "n_items": len(records),
      "accuracy": float(np.mean(correct)) if correct else None,
      "mean_nfe": float(np.mean([r.get("nfe", r["steps"]) for r in records])),
      "sink_fraction": float(np.sum([r["sink_fraction"] * r["n_entries"] for r in records]) / max(n_entries.sum(), 1)),
      "nonsink_fraction_curve": {"epsilon": epsilon_grid, "fraction": nonsink},
      "score_histogram": np.sum([r["score_histogram"] for r in records], axis=0),
      "main_sink_grid": _nanmean([r["main_sink_grid"] for r in records]),
      "sink_tokens": [(t, n / total) for t, n in tokens.most_common()] if total else [],
      "moving_per_layer": {k: _nanmean([r["moving"][k] for r in records]) for k in MOVING_KEYS},
      "first_token_share_per_layer": _nanmean([r["first_token_share"] for r in records]),
      "largest_at_first_token": float(np.mean([r["largest_at_first_token"] for r in records])),
      "largest_in_prompt": float(np.mean([r["largest_in_prompt"] for r in records])),
  }
  if records and all("routing" in r for r in records):
    agg["routing"] = _routing_aggregate(records)
  if all("separate_sinks" in r for r in records):
    agg["separate_sinks_per_layer"] = _nanmean([r["separate_sinks"] for r in records])
  index = np.argmin(np.abs(epsilon_grid - epsilon))
  agg["nonsink_fraction_at_epsilon"] = float(nonsink[index]) if abs(epsilon_grid[index] - epsilon) < 1e-9 else \
      1.0 - agg["sink_fraction"]
  return agg


def _routing_aggregate(records: list[dict]) -> dict:
  """Expert shares of sink and non-sink routing slots per layer, their JS divergence and the top sink experts."""
  sink = np.sum([r["routing"]["sink_counts"] for r in records], axis=0)  # [L', E]
  other = np.sum([r["routing"]["nonsink_counts"] for r in records], axis=0)
  sink_shares, other_shares = routing.shares(sink), routing.shares(other)
  top = np.argsort(-sink_shares, axis=-1, kind="stable")[:, :2]
  return {"sink_slots": sink.sum(-1), "nonsink_slots": other.sum(-1), "sink_shares": sink_shares,
          "nonsink_shares": other_shares, "js_divergence": routing.js_divergence(sink_shares, other_shares),
          "top_sink_experts": top,
          "top_sink_expert_shares": np.take_along_axis(sink_shares, top, -1),
          "top_sink_expert_nonsink_shares": np.take_along_axis(other_shares, top, -1)}


def _track_heads(grid: np.ndarray, layers: list[int], requested: list[str]) -> list[tuple[int, int]]:
  """(index into the recorded layers, head) pairs for Fig. 7."""
  if requested:
    pairs = []
    for entry in requested:
      layer, _, head = entry.partition(":")
      if int(layer) in layers:
        pairs.append((layers.index(int(layer)), int(head)))
    return pairs
  order = np.argsort(-np.nan_to_num(grid, nan=-np.inf).ravel(), kind="stable")[:3]
  return [tuple(int(i) for i in np.unravel_index(o, grid.shape)) for o in order]


def token_strings(data, ids: np.ndarray) -> list[str] | None:
  """The token text of ids [S] from an item .npz's vocab_ids / vocab_text (None for a run written before they
  were recorded)."""
  if "vocab_ids" not in data:
    return None
  vocab = dict(zip(data["vocab_ids"].tolist(), data["vocab_text"].tolist()))
  return [vocab.get(int(i), "?") if i >= 0 else "·" for i in ids]


def _read_tracks(model_dir: str) -> dict[str, dict[str, np.ndarray]]:
  """{item id: arrays} of <model>/tracks/item_<id>.npz, in item order."""
  folder = os.path.join(model_dir, "tracks")
  if not os.path.isdir(folder):
    return {}
  names = [n for n in os.listdir(folder) if n.startswith("item_") and n.endswith(".npz")]
  ids = sorted((n[len("item_"):-len(".npz")] for n in names), key=lambda i: (not i.isdigit(), int(i) if i.isdigit()
                                                                            else 0, i))
  out = {}
  for item in ids:
    with np.load(os.path.join(folder, f"item_{item}.npz")) as data:
      out[item] = {k: data[k] for k in data.files}
  return out


def _moving_figure(label: str, meta: dict, tracks: dict[str, dict[str, np.ndarray]], step_label: str):
  """The moving-sink figure (`plots.moving_sinks`) on the item and heads chosen by `figure_axes`' rule."""
  ran = {item: a["largest"][:figure_axes.steps_that_ran(a["valid"])] for item, a in tracks.items()}
  item = figure_axes.most_moving_item(ran)
  if item is None:
    return None
  data, layers = tracks[item], meta["layers"]
  heads = figure_axes.moving_heads(ran[item], k=4)
  lp, total = int(data["prompt_length"]), data["tokens"].shape[-1]
  block = meta.get("block_length")
  blocks = list(range(lp + block, total, block)) if meta["diffusion"] and block else []
  panels = [(f"layer {layers[l]} head {h}: {moves} move{'s' if moves != 1 else ''}", ran[item][:, l, h])
            for l, h, moves in heads]
  decode_step = np.full(total, -1)
  if "step_index" in data:  # the sampler step of each position -> its index among the decoded steps shown
    shown = data["step_index"][:len(ran[item])]
    steps = data["decode_step"][:total - lp]
    index = np.searchsorted(shown, steps)
    found = (index < len(shown)) & (shown[np.minimum(index, len(shown) - 1)] == steps)
    decode_step[lp:] = np.where(found, index, -1)
  return plots.moving_sinks(
      panels, f"{label}: moving sinks — largest sink per step, item {item}, the {len(heads)} heads whose largest "
      "sink moves most\n(rule: most position changes between consecutive steps; item: where the top head moves "
      "most)", tokens=token_strings(data, data["tokens"]), prompt_length=lp, block_starts=blocks,
      decode_step=decode_step if meta["diffusion"] else None, xlabel=step_label)


def model_figures(out: str, meta: dict, agg: dict, track_heads: list[str], figure_item: str) -> list[str]:
  """Writes the per-model PNGs; returns their paths relative to `out`."""
  label, layers = meta["label"], meta["layers"]
  model_dir = os.path.join(out, label)
  written = []

  def save(fig, name):
    atomic_files.save_figure(fig, os.path.join(model_dir, name))
    written.append(os.path.join(label, name))

  save(plots.layer_head_grid(agg["main_sink_grid"], f"{label}: main-sink score per (layer, head), mean over "
                             "steps and prompts (Fig. 5)", layers=layers), "fig5_main_sink_grid.png")
  if "routing" in agg:
    moe = [i for i, n in enumerate(agg["routing"]["sink_slots"] + agg["routing"]["nonsink_slots"]) if n]
    save(plots.expert_share_panels([f"layer {layers[i]}" for i in moe], agg["routing"]["sink_shares"][moe],
                                   agg["routing"]["nonsink_shares"][moe],
                                   f"{label}: experts chosen for sink tokens and for the others"),
         "fig_routing_sinks.png")
  step_label = "denoising step" if meta["diffusion"] else "decoding step (0 = prefill)"
  tracks = _read_tracks(model_dir)
  if tracks:
    save(_moving_figure(label, meta, tracks, step_label), "fig_moving_sinks.png")
  npz_path = os.path.join(model_dir, f"item_{figure_item}.npz")
  if not os.path.exists(npz_path):
    return written
  data = np.load(npz_path)
  lp = int(data["prompt_length"])
  total = data["layer_scores"].shape[-1]
  ran = figure_axes.steps_that_ran(data["valid"])
  tokens = token_strings(data, data["tokens"])
  block = meta.get("block_length")
  blocks = list(range(lp + block, total, block)) if meta["diffusion"] and block else []
  picks = figure_axes.shown_layers(layers)
  shown = ", ".join(str(layers[i]) for i in picks)
  of_all = "all layers" if len(picks) == len(layers) else f"layers {shown} of the {len(layers)} recorded"
  xlabel = "key position"
  panels = [(f"layer {layers[i]}, head mean", data["layer_scores"][:ran, i]) for i in picks]
  save(plots.step_heatmaps(panels, f"{label}: incoming attention per key across the {ran} steps that ran, prompt "
                           f"{figure_item}, {of_all} (Fig. 1)", prompt_length=lp, block_starts=blocks,
                           xlabel=xlabel, ylabel=step_label, tokens=tokens),
       "fig1_incoming_heatmap.png")
  tracks_shown = {f"layer {layers[l]} head {h}": data["largest"][:ran, l, h]
                  for l, h in _track_heads(agg["main_sink_grid"], layers, track_heads)}
  save(plots.largest_sink_tracks(tracks_shown, f"{label}: largest sink per step, prompt {figure_item}, the heads "
                                 "with the largest main-sink score (Fig. 7)", prompt_length=lp, total_length=total,
                                 block_starts=blocks, tokens=tokens, xlabel=step_label), "fig7_largest_sink.png")
  if "group_incoming" in data:
    groups = data["group_incoming"][:ran, -1]  # [steps, 2, S]
    shares = groups / np.maximum(groups.sum(-1, keepdims=True), 1e-30)
    uniform_state = registry.get(meta["sampler"]).self_conditioning  # its canvas holds tokens, not masks
    names = ("not-yet-accepted", "accepted") if uniform_state else ("masked", "unmasked")
    panels = [(f"{names[0]} queries, layer {layers[-1]}", shares[:, 0]),
              (f"{names[1]} queries, layer {layers[-1]}", shares[:, 1])]
    save(plots.step_heatmaps(panels, f"{label}: share of each query group's attention per key, last recorded layer "
                             f"({layers[-1]}) (Fig. 6a)", prompt_length=lp, block_starts=blocks, xlabel=xlabel,
                             ylabel=step_label, colorbar_label="share of the group's attention", tokens=tokens),
         "fig6a_query_groups.png")
  if not meta["diffusion"]:
    prefill = data["layer_scores"][0][:, :lp]  # [L', Lp]
    save(plots.step_heatmaps([("prefill (all prompt queries), head mean", prefill)],
                             f"{label}: incoming attention over the prompt per layer", xlabel="prompt position",
                             ylabel="layer", tokens=tokens[:lp] if tokens else None,
                             row_labels=[str(l) for l in layers]), "prefill_incoming.png")
  return written


def _fmt(x, digits=3):
  if x is None or (isinstance(x, float) and not np.isfinite(x)):
    return "–"
  return f"{x:.{digits}f}"


def _markdown(metas, aggs, figures, epsilon, top_tokens, wall_s) -> list[str]:
  """The lines of summary.md."""
  reported = [(meta, aggs[meta["label"]]) for meta in metas if meta["label"] in aggs]  # the models with results
  lines = ["# Attention sinks across denoising steps (Rulli et al. §4): `experiments.sink_analysis`", ""]
  lines.append(f"Scores are incoming attention relative to the uniform share (column sums over all queries for "
               f"DLMs; an ARM step's newest query row × the number of keys it sees). A key is a sink when its score "
               f"exceeds the mean of the other keys by ε = {epsilon:g} (Eq. 3). Every measure reads only the steps "
               f"each generation decoded at (NFE per row). Wall time {wall_s:.0f}s.")
  if any(MODES.get(m["settings"].get("decoding", "exact"), ("", "none"))[1] != "none" for m in metas):
    lines += ["", CACHE_NOTE]
  lines += ["", "| model | sampler | task / prompts | accuracy | NFE per row | "
            "sinks (fraction of step·layer·head·key) | non-sinks at ε | largest sink in prompt | "
            "largest sink = first token | first-token share (last layer) |",
            "|---|---|---|---|---|---|---|---|---|---|"]
  for meta, agg in reported:
    s = meta["settings"]
    sampler = ", ".join(f"{k}={v}" for k, v in s.items() if v is not None)
    lines.append(f"| {meta['label']} | {sampler} | {meta['task']} / {agg['n_items']} | {_fmt(agg['accuracy'], 2)} | "
                 f"{_fmt(agg['mean_nfe'], 1)} | {_fmt(agg['sink_fraction'], 4)} | "
                 f"{_fmt(agg['nonsink_fraction_at_epsilon'], 4)} | "
                 f"{_fmt(agg['largest_in_prompt'], 2)} | {_fmt(agg['largest_at_first_token'], 2)} | "
                 f"{_fmt(float(agg['first_token_share_per_layer'][-1]), 3)} |")
  lines += ["", "## Most frequent sink tokens (Table 2)", "",
            "Relative frequency among all (step, layer, head, position) entries flagged as sinks.", ""]
  for meta, agg in reported:
    top = ", ".join(f"`{t!r}` {f:.3f}" for t, f in agg["sink_tokens"][:top_tokens]) or "no sinks"
    lines.append(f"- **{meta['label']}**: {top}")
  lines += ["", "Paper (30 generations, length 128, 128 steps, block 32):"]
  for name, row in PAPER_TABLE2.items():
    lines.append(f"- {name}: " + ", ".join(f"`{t}` {f:.3f}" for t, f in row))
  lines += ["", "## Per layer: sink counts, moving sinks, first-token share, separate sinks", "",
            "sinks/head: mean number of sinks per (step, head); with sink: fraction of (step, head) with a sink; "
            "change: fraction of consecutive steps whose largest sink moved; drift: mean |Δ position| (signed: "
            "> 0 moves right); lifetime: mean run length (steps) of a position staying a sink; centroid var: "
            "variance over steps of the sink centroid (Sink-Aware Pruning); first share: attention share of the "
            "first real token; separate: fraction of (step, head) where masked and unmasked queries have "
            "different top keys (Fig. 6a; for a uniform-state model, not-yet-accepted and accepted queries)."]
  for meta, agg in reported:
    moving = agg["moving_per_layer"]
    lines += ["", f"**{meta['label']}**", "",
              "| layer | sinks/head | with sink | change | drift | signed drift | lifetime | centroid var | "
              "first share | separate |", "|---|---|---|---|---|---|---|---|---|---|"]
    separate = agg.get("separate_sinks_per_layer")
    for i, layer in enumerate(meta["layers"]):
      lines.append(f"| {layer} | " + " | ".join(_fmt(float(moving[k][i]), 2) for k in MOVING_KEYS)
                   + f" | {_fmt(float(agg['first_token_share_per_layer'][i]), 3)} | "
                   + (_fmt(float(separate[i]), 2) if separate is not None else "–") + " |")
  routed = [(meta, agg) for meta, agg in reported if "routing" in agg]
  if routed:
    lines += ["", "## Routing of sinks (mixture-of-experts models)", "",
              "Per MoE layer: routing slots (k per token and step) of the sink tokens and of the others, the "
              "Jensen–Shannon divergence (bits) between their expert distributions (0 = routed alike), and the "
              "two experts sinks go to most, with their share among the sinks' slots and among the others'."]
  for meta, agg in routed:
    r = agg["routing"]
    lines += ["", f"**{meta['label']}**", "", "| layer | sink slots | other slots | JS divergence | top sink experts "
              "(share of sinks / of others) |", "|---|---|---|---|---|"]
    for i, layer in enumerate(meta["layers"]):
      if not r["sink_slots"][i] + r["nonsink_slots"][i]:
        continue  # a dense layer
      tops = ", ".join(f"{int(e)} ({a:.2f} / {b:.2f})" for e, a, b in zip(
          r["top_sink_experts"][i], r["top_sink_expert_shares"][i], r["top_sink_expert_nonsink_shares"][i]))
      lines.append(f"| {layer} | {int(r['sink_slots'][i])} | {int(r['nonsink_slots'][i])} | "
                   f"{_fmt(float(r['js_divergence'][i]), 3)} | {tops} |")
  lines += ["", "## Against the paper", "",
            "- ε = 3 filters out at least 96% of tokens for all three DLMs (App. B, Fig. 10): compare the "
            "'non-sinks at ε' column and fig10_nonsink_fraction.png.",
            "- LLaDA: moving sinks that stay a few steps then vanish; deeper layers converge to 1–2 sinks per layer; "
            "the largest sink shifts right as blocks are denoised (Fig. 7); masked and unmasked queries keep "
            "separate sinks in deep layers (Fig. 6a).",
            "- Dream: positional sinks starting at the rightmost masked token and moving left; MMaDA: static, rarer "
            "sinks, often at the first position.",
            "- ARMs: a static sink on the first token (StreamingLLM, Gu et al.); compare 'largest sink = first token'.",
            "- Uniform-state models (DiffusionGemma-style, no mask token; not in the paper): a decoder step's "
            "queries are its canvas, over the prompt cache and the canvas; there is no mask token to become a "
            "sink, so the table shows which tokens and positions do.",
            "", "## Figures", ""]
  for path in figures:
    lines.append(f"- [{path}]({path})")
  return lines


def write_report(out, metas, records, epsilon_grid, epsilon, edges, track_heads, figure_item, top_tokens,
                 wall_s) -> str:
  """Writes every figure, summary.json and summary.md; returns the markdown."""
  aggs, figures = {}, []
  for meta in metas:
    rows = [r for r in records if r["model"] == meta["label"]]
    if rows:
      aggs[meta["label"]] = aggregate(rows, epsilon_grid, epsilon)
      figures += model_figures(out, meta, aggs[meta["label"]], track_heads, figure_item)
  if aggs:
    atomic_files.save_figure(plots.score_histogram(edges, {k: a["score_histogram"] for k, a in aggs.items()}, epsilon,
                                             "Scores of every (step, layer, head, key) (Fig. 3)"),
                       os.path.join(out, "fig3_score_histogram.png"))
    atomic_files.save_figure(plots.nonsink_fraction(epsilon_grid, {k: a["nonsink_fraction_curve"]["fraction"]
                                                             for k, a in aggs.items()}, epsilon,
                                              "Fraction of non-sinks against ε (Fig. 10)"),
                       os.path.join(out, "fig10_nonsink_fraction.png"))
    figures = ["fig3_score_histogram.png", "fig10_nonsink_fraction.png"] + figures
  return summary_files.write(out, {"models": metas, "aggregates": aggs, "epsilon": epsilon, "wall_s": wall_s},
                             _markdown(metas, aggs, figures, epsilon, top_tokens, wall_s))
