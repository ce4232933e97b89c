"""Tables, figure and summary of `experiments.sink_masking_eval`, rebuilt from results.jsonl alone (so a
resumed run reports exactly what an uninterrupted one does)."""

from __future__ import annotations

import math
import os

import numpy as np

from experiments.common import atomic_files
from experiments.reports import plots

CONDITION_NAMES = {"none": "no masking", "first": "first token masked"}


def binomial_se(p: float, n: int) -> float:
  """sqrt(p(1 − p)/n): the standard error of an accuracy p measured on n items."""
  return math.sqrt(p * (1.0 - p) / n) if n else float("nan")


def accuracy_table(records: list[dict], labels: list[str], ks: list[int]) -> dict:
  """{model: {K: {n, accuracy, se, strict_accuracy?, mean_nfe?}}} from the accuracy records (mean_nfe: the
  model calls per item, when the records hold them)."""
  table = {}
  for label in labels:
    table[label] = {}
    for k in ks:
      rows = [r for r in records if r["kind"] == "accuracy" and r["model"] == label and r["condition"] == k]
      n = len(rows)
      p = float(np.mean([r["correct"] for r in rows])) if n else float("nan")
      cell = {"n": n, "accuracy": p, "se": binomial_se(p, n)}
      if rows and all("strict_match" in r for r in rows):
        cell["strict_accuracy"] = float(np.mean([r["strict_match"] for r in rows]))
      if rows and all("nfe" in r for r in rows):
        cell["mean_nfe"] = float(np.mean([r["nfe"] for r in rows]))
      table[label][str(k)] = cell
  return table


def perplexity_table(records: list[dict], labels: list[str]) -> dict:
  """{model: {condition: {perplexity, nll_per_token, n_tokens, n_texts}}}: exp(Σ NLL / Σ tokens)."""
  table = {}
  for label in labels:
    rows = [r for r in records if r["kind"] == "perplexity" and r["model"] == label]
    if not rows:
      continue
    conditions = list(dict.fromkeys(r["condition"] for r in rows))
    table[label] = {}
    for c in conditions:
      sub = [r for r in rows if r["condition"] == c]
      nll, tokens = sum(r["nll"] for r in sub), sum(r["n_tokens"] for r in sub)
      table[label][c] = {"perplexity": math.exp(nll / tokens) if tokens else float("nan"),
                         "nll_per_token": nll / tokens if tokens else float("nan"), "n_tokens": tokens,
                         "n_texts": len(sub)}
  return table


def _condition(k: int) -> str:
  return "no masking" if k == 0 else f"top-{k} masked"


def accuracy_markdown(table: dict, metas: list[dict], ks: list[int]) -> str:
  heads = [f"{m['label']} ({m['task']}, n = {table[m['label']][str(ks[0])]['n']})" for m in metas]
  lines = ["| sinks | " + " | ".join(heads) + " |", "|---|" + "---|" * len(metas)]
  for k in ks:
    cells = []
    for m in metas:
      cell = table[m["label"]][str(k)]
      cells.append("–" if not cell["n"] else f"{cell['accuracy']:.2f} ± {cell['se']:.2f}")
    lines.append(f"| {_condition(k)} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def nfe_markdown(table: dict, metas: list[dict], ks: list[int]) -> str:
  """Mean NFE per item for each model and K ("–" where the records hold none)."""
  lines = ["| sinks | " + " | ".join(m["label"] for m in metas) + " |", "|---|" + "---|" * len(metas)]
  for k in ks:
    cells = [table[m["label"]][str(k)].get("mean_nfe") for m in metas]
    lines.append(f"| {_condition(k)} | " + " | ".join("–" if c is None else f"{c:.1f}" for c in cells) + " |")
  return "\n".join(lines)


def perplexity_markdown(table: dict) -> str:
  labels = list(table)
  conditions = list(dict.fromkeys(c for label in labels for c in table[label]))
  lines = ["| condition | " + " | ".join(f"{l} (tokens: {next(iter(table[l].values()))['n_tokens']})" for l in labels)
           + " |", "|---|" + "---|" * len(labels)]
  for c in conditions:
    name = CONDITION_NAMES.get(c, c.replace("_static", " static sinks masked").replace("top", "top-"))
    cells = [f"{table[l][c]['perplexity']:.2f}" if c in table[l] else "–" for l in labels]
    lines.append(f"| {name} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def paper_markdown(paper: dict) -> str:
  lines = []
  for bench, columns in paper.items():
    lines += ["", f"Rulli et al. Table 1, {bench}:", "", "| sinks | " + " | ".join(columns) + " |",
              "|---|" + "---|" * len(columns)]
    for i, name in enumerate(["no masking", "top-1 masked", "top-5 masked", "top-10 masked"]):
      lines.append(f"| {name} | " + " | ".join(v[i] for v in columns.values()) + " |")
  return "\n".join(lines)


def _recompute_note(metas: list[dict]) -> str:
  lines = ["", "## Recomputing an item", "",
           "Every line of results.jsonl holds the item's `prompt_ids` (exactly what a single-item run is given; "
           "for a DLM in the training layout the left pads are part of the prompt) and its `completion_ids`. "
           "For a DLM, `python -m experiments.generate --checkpoint=DIR --prompt_ids=<prompt_ids> "
           "--sampler=llada --gen_length=G --steps=T --block_length=B --mask_sinks=K --json_out=x.json` decodes "
           "the same tokens (same `MaskPreviousSinks(top_k=K)`, per (layer, head), first step unmasked); add "
           "`--decoding=... --threshold=τ` (or `--factor=f`) when the settings below name a decoding mode, and "
           "`--policy=...` when they name a compute policy."]
  if any(not m["diffusion"] for m in metas):
    lines.append("For an ARM the sinks of an iteration are the top-K keys of the previous iteration's last query "
                 "row (`MaskPreviousSinksAR(last_row_weights=True)`, exact at the prefill too); "
                 "`experiments.generate --mask_sinks=K` uses that call's column sums at the prefill instead, so it "
                 "matches only with `--ar_last_row=false` here.")
  lines += ["", "Settings per model:", ""]
  for m in metas:
    lines.append(f"- {m['label']} ({m['directory']}): " + ", ".join(f"{k}={v}" for k, v in m["settings"].items())
                 + f"; prompts: {m['prompt_format']}")
  return "\n".join(lines)


def write_report(out: str, metas: list[dict], records: list[dict], ks: list[int], paper: dict, wall_s: float) -> str:
  """Writes table.json, table.md, masking_accuracy.png and summary.md; returns the summary text."""
  labels = [m["label"] for m in metas]
  accuracy = accuracy_table(records, labels, ks)
  ppl = perplexity_table(records, labels)
  atomic_files.write_json(os.path.join(out, "table.json"), {"accuracy": accuracy, "perplexity": ppl, "top_k": ks,
                                                      "models": metas, "standard_error": "sqrt(p(1-p)/n)"})
  acc_md = accuracy_markdown(accuracy, metas, ks)
  table_md = "## Accuracy with the previous step's top-K sinks masked\n\n" + acc_md + "\n"
  if ppl:
    table_md += "\n## Perplexity (teacher forcing)\n\n" + perplexity_markdown(ppl) + "\n"
  atomic_files.write_text(os.path.join(out, "table.md"), table_md)
  series = {label: (np.asarray([accuracy[label][str(k)]["accuracy"] for k in ks]),
                    np.asarray([accuracy[label][str(k)]["se"] for k in ks])) for label in labels}
  atomic_files.save_figure(plots.accuracy_vs_masked(ks, series, "Accuracy with the previous step's top-K sinks masked"),
                     os.path.join(out, "masking_accuracy.png"))
  lines = ["# Sink masking (Rulli et al. Table 1): `experiments.sink_masking_eval`", "",
           "At every step after the first, the K keys that received the most attention at the previous step "
           "are removed from attention (per (layer, head) unless --mask_scope=global); ARMs use the previous "
           "iteration's last query row. Accuracy ± binomial standard error sqrt(p(1−p)/n) over the n items. "
           f"Wall time {wall_s:.0f}s.", "", acc_md]
  if any("mean_nfe" in cell for label in labels for cell in accuracy[label].values()):
    lines += ["", "Model calls (NFE) per item, mean:", "", nfe_markdown(accuracy, metas, ks)]
  if ppl:
    lines += ["", "Perplexity of causal models (teacher forcing; 'first token masked': key 0 hidden from every "
              "other query; 'top-K static': per (layer, head) the K keys with the most incoming attention in the "
              "unmasked pass hidden from every other query):", "", perplexity_markdown(ppl)]
  lines += ["", "## The paper", paper_markdown(paper), "",
            "Claims: DLMs lose little with one sink masked (Dream −0.03, LLaDA −0.01, MMaDA −0.01 on GSM8K) and more "
            "only at top-10 (LLaDA −0.21, MMaDA −0.17 on GSM8K); LLaMA-3.1-8B collapses once its sink is masked "
            "(0.85 → 0.02).", "", "![accuracy](masking_accuracy.png)"]
  text = "\n".join(lines) + "\n" + _recompute_note(metas) + "\n"
  atomic_files.write_text(os.path.join(out, "summary.md"), text)
  return text
