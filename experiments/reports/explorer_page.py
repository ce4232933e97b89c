"""The explorer page of `experiments.explore` (module docstring there: what it shows, the data format):
its data from a run directory, and the self-contained HTML (style, script and data inline)."""

from __future__ import annotations

import base64
import glob
import json
import os

import numpy as np

from experiments.reports import figure_axes, palette
from experiments.common import atomic_files, cli, progress

ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "explorer_assets")
PAGE_FILE = "explorer.html"
"""The page's name inside an analysis binary's output directory (--html)."""


def _read_json(path: str) -> dict:
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except json.JSONDecodeError as e:
    raise cli.UserError(f"{path} is not valid JSON ({e})") from None


def _read_jsonl(path: str) -> list[dict]:
  if not os.path.isfile(path):
    return []
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def _quantised(scores: np.ndarray) -> tuple[list[float], str]:
  """(per-(layer, head) maxima, base64 uint8 levels) of scores [T, L', H, S]: level = 255·√(score / max)."""
  scores = np.nan_to_num(np.maximum(np.asarray(scores, np.float32), 0.0))
  top = scores.max(axis=(0, 3))  # [L', H]
  levels = np.round(255 * np.sqrt(scores / np.maximum(top, 1e-30)[None, :, :, None]))
  return [float(x) for x in top.ravel()], base64.b64encode(levels.astype(np.uint8).tobytes()).decode()


def model_data(run: str, meta: dict, item: str, records: list[dict]) -> dict | None:
  """A model's entry of the page data (module docstring), or None when its item .npz is missing."""
  path = os.path.join(run, meta["label"], f"item_{item}.npz")
  if not os.path.isfile(path):
    return None
  with np.load(path) as npz:
    data = {k: npz[k] for k in npz.files}
  if "head_scores" not in data:
    raise cli.UserError(f"{path} has no per-head scores (written before the explorer existed); rerun "
                        "experiments.sink_analysis with --overwrite")
  ran = figure_axes.steps_that_ran(data["valid"])
  lp, tokens = int(data["prompt_length"]), data["tokens"]
  scores = data["head_scores"][:ran].astype(np.float32)  # [T, L', N, S]
  scores = np.concatenate([scores, scores.mean(2, keepdims=True)], axis=2)
  sink_mask = data["head_sinks"][:ran]
  sink_mask = np.concatenate([sink_mask, sink_mask.any(2, keepdims=True)], axis=2)
  maxima, levels = _quantised(scores)
  vocab = dict(zip(data["vocab_ids"].tolist(), data["vocab_text"].tolist()))
  decode_step = np.full(tokens.shape[-1], -1)
  decode_step[lp:] = data["decode_step"][:tokens.shape[-1] - lp]
  record = next((r for r in records if r["model"] == meta["label"] and str(r["item"]) == item), {})
  out = {"label": meta["label"], "sampler": meta["sampler"], "item": item, "prompt": record.get("prompt", ""),
         "completion": record.get("completion", ""), "layers": [int(l) for l in meta["layers"]],
         "n_heads": int(meta["n_heads"]), "prompt_length": lp, "tokens": [vocab.get(int(t), "?") for t in tokens],
         "decode_step": [int(d) for d in decode_step], "steps": [int(s) for s in data["step_index"][:ran]],
         "canvas": data["canvas"][:ran].tolist(), "vocab": {str(k): v for k, v in vocab.items()},
         "attention": {"shape": list(scores.shape), "max": maxima, "q": levels},
         "sinks": [[[np.flatnonzero(sink_mask[t, l, h]).tolist() for h in range(sink_mask.shape[2])]
                    for l in range(sink_mask.shape[1])] for t in range(ran)]}
  if "correct" in record:
    out["correct"] = bool(record["correct"])
  if "policy" in data:
    out["policy"] = _policy(data, ran)
  if "revoked" in data:
    out.update(_revisions(data["committed"][:ran], data["revoked"][:ran], decode_step, data["canvas"][:ran],
                          data["step_index"][:ran], vocab))
  return out


def _bits(mask: np.ndarray) -> dict:
  """{"shape", "bits"}: a bool array as base64 of its bits, C order, least significant bit first."""
  mask = np.asarray(mask, bool)
  return {"shape": list(mask.shape), "bits": base64.b64encode(np.packbits(mask.ravel(), bitorder="little")).decode()}


def _policy(data: dict, ran: int) -> dict:
  """A compute policy's entry of a model (module docstring), from the item's policy_* arrays
  (`experiments.reports.policy_view`) at the steps that ran."""
  out = {"text": str(data["policy"]), "computed": _bits(data["policy_computed"][:ran]),
         "keys_read": [float(k) for k in data["policy_keys_read"][:ran]],
         "notes": [str(n) for n in data["policy_notes"][:ran]]}
  for name in ("keys", "layers"):
    if f"policy_{name}" in data:
      out[name] = _bits(data[f"policy_{name}"][:ran])
  return out


def _revisions(committed, revoked, decode_step, canvas, steps, vocab) -> dict:
  """A decoding rule's drafts (module docstring): per step shown, the positions it re-masked ("revoked",
  shown with the draft the step read) and those holding a draft a later step revokes ("drafted", with its
  text). committed / revoked [T, S] bool, decode_step [S], canvas [T, S], steps [T]."""
  holding, drafted, texts = {}, [], []
  for t in range(len(steps)):
    for p in np.flatnonzero(revoked[t]):
      holding.pop(int(p), None)
    for p in np.flatnonzero(committed[t]):
      holding[int(p)] = int(steps[t])
    later = {p: s for p, s in holding.items() if decode_step[p] != s}
    drafted.append(sorted(later))
    step_read = canvas[t + 1] if t + 1 < len(steps) else None
    texts.append([vocab.get(int(step_read[p]), "?") if step_read is not None else "?" for p in sorted(later)])
  return {"revoked": [np.flatnonzero(r).tolist() for r in revoked], "drafted": drafted, "draft_text": texts}


def masking_data(masking_dir: str, item: str | None) -> dict:
  """{"models": {label: {"item", "rows"}}} of a sink_masking_eval run: each model's completion of `item`
  (default: the first item of the run) under every masking condition, K ascending."""
  records = [r for r in _read_jsonl(os.path.join(masking_dir, "results.jsonl")) if r.get("kind") == "accuracy"]
  if not records:
    raise cli.UserError(f"{masking_dir} holds no sink_masking_eval results (results.jsonl with accuracy lines)")
  chosen = item if item is not None and any(str(r["item"]) == item for r in records) else str(records[0]["item"])
  models = {}
  for r in records:
    if str(r["item"]) != chosen:
      continue
    row = {"k": int(r["condition"]), "text": r.get("completion", ""), "nfe": r.get("nfe")}
    if "correct" in r:
      row["correct"] = bool(r["correct"])
    models.setdefault(r["model"], {"item": chosen, "rows": []})["rows"].append(row)
  for entry in models.values():
    entry["rows"].sort(key=lambda row: row["k"])
  return {"models": models}


def capture_panels(run: str) -> list[dict]:
  """The panels of RUN_DIR/captures/*.json (module docstring), checked."""
  panels = []
  for path in sorted(glob.glob(os.path.join(run, "captures", "*.json"))):
    value = _read_json(path)
    for panel in value if isinstance(value, list) else [value]:
      if not isinstance(panel, dict) or panel.get("kind") != "grid" or not {"title", "rows", "cols", "values"} <= set(
          panel):
        raise cli.UserError(f"{path}: expected a panel {{title, kind: grid, rows, cols, values}} or a list of them")
      panels.append(panel)
  return panels


def page_data(run: str, masking_dir: str | None = None) -> dict:
  """The page's data (module docstring) of a sink_analysis or sink_masking_eval run directory."""
  run = os.path.abspath(run)
  if not os.path.isdir(run):
    raise cli.UserError(f"RUN_DIR {run}: no such directory")
  summary_path = os.path.join(run, "summary.json")
  models, item = [], None
  if os.path.isfile(summary_path) and "models" in (summary := _read_json(summary_path)):
    item = str(_read_json(os.path.join(run, "run.json"))["settings"]["figure_item"])
    records = _read_jsonl(os.path.join(run, "results.jsonl"))
    models = [m for m in (model_data(run, meta, item, records) for meta in summary["models"]) if m is not None]
  elif masking_dir is None and os.path.isfile(os.path.join(run, "results.jsonl")):
    masking_dir = run
  else:
    raise cli.UserError(f"{run} is not a finished sink_analysis run (no summary.json with models) nor a "
                        "sink_masking_eval run")
  masking = masking_data(masking_dir, item) if masking_dir else None
  if not models and masking is None:
    raise cli.UserError(f"{run}: nothing to show (no item .npz of the figure item)")
  colours = {"sink": palette.SINK, "masked": palette.MASKED, "decoded": palette.DECODED,
             "fresh": palette.JUST_COMMITTED, "promptend": palette.PROMPT_END}
  return {"version": 1, "title": f"Decoding explorer: {progress.display_path(run)}", "palette": colours,
          "models": models, "masking": masking, "panels": capture_panels(run)}


def render(data: dict) -> str:
  """The page: explorer.html with the style, the data and the script inlined."""
  def asset(name):
    with open(os.path.join(ASSETS, name), encoding="utf-8") as f:
      return f.read()
  payload = json.dumps(data, separators=(",", ":")).replace("</", "<\\/").replace("<!--", "<\\!--")
  page = asset("explorer.html")
  for marker, text in (("/*CSS*/", asset("explorer.css")), ("/*JS*/", asset("explorer.js")), ("/*DATA*/", payload)):
    page = page.replace(marker, text, 1)
  return page


def write_page(run: str, path: str, masking_dir: str | None = None) -> int:
  """Writes the page of `run` to `path` atomically; returns its size in bytes."""
  text = render(page_data(run, masking_dir)).encode("utf-8")
  atomic_files.atomic_write_bytes(path, text)
  return len(text)
