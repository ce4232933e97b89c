r"""The logit lens at every denoising step: when and where does a diffusion LM compute its answer?

  python -m experiments.logit_lens                        # the embedded DLMs and the ARM, synthetic task
  python -m experiments.logit_lens --checkpoints=tiny-dlm --lens_steps=every:4 --lens_top_k=10
  python -m experiments.logit_lens --checkpoints=llada=/ckpt/llada-8b-instruct --task=gsm8k_test.jsonl \
      --gen_length=128 --steps=128 --block_length=32 --lens_steps=every:8 --dtype=bfloat16

For every prompt the model decodes as usual, then decodes again with the same key while every layer's
residual stream (the token embeddings, row "embed", and each block's output, rows L0..L{L−1}; the last is
the model's own prediction) goes through the final norm and the LM head at the kept steps, read at the token
finally decoded there: its probability, its rank and the --lens_top_k most probable tokens
(`dlm_jax.analysis.logit_lens`). A step is one model call. A position is read at a step while its token is
still undecided (diffusion: still masked — DiffusionGemma: not holding an accepted token; its encoder calls
read nothing); for an autoregressive model each step reads one position: step i is the call that produces
generated token i, read at the position it feeds (the prompt's last token at step 0), whose output predicts
token i. Only the answer is read: the generated positions up to and including the first token that ends it
(EOS, end of turn, or PAD in the training layout), so the trailing EOS padding of a diffusion model does not
count.

--lens_steps: all, every:K (0, K, 2K, …) or a comma-separated list of step numbers. --capture_budget_gb:
the capture plan's bytes per sampler call are printed before any model runs, and a plan over the budget is
refused with how to shrink it.

Tasks, prompts, decoding defaults, --padding and per-item keys as in the other analysis binaries
(`experiments.common.items`, `prompts`, `decoding`). run.json records the settings (a resume with other
settings is refused); nothing is written before the first result.

Outputs in --output_dir (default results/logit_lens): results.jsonl (one line per model and prompt: per
kept step the positions read and, per lens row, the sums of p(final token), of its rank and the count of
top-1; the first row with the final token top-1 at every (step, position); each row's --lens_top_k tokens
at each position's first and last step read; the decoded tokens),
summary.json, summary.md, and per model <model>/lens_probability.png (step × row mean p(final token)) and
<model>/example_first_top1.png (one prompt: per step and position, labelled by its final token, the first
row at which that token is top-1).
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from dlm_jax.analysis import logit_lens
from dlm_jax.instrument.hook_call import CaptureValues, hook_values
from dlm_jax.instrument.hook_spec import Steps
from dlm_jax.model import init_params
from dlm_jax.session import checkpoint_bundle, decode_settings, size_limits
from dlm_jax.session.decode_settings import DecodeSettings
from experiments.common import (analysis_flags, atomic_files, capture_budget, checkpoints, cli, decoding, devices,
                                flag_checks, item_batches, items, model_runs, numerics, numerics_flags, progress,
                                prompts, run_dir)
from experiments.common.items import TaskSettings
from experiments.common.numerics import Numerics
from experiments.reports import figure_axes, lens_plots, summary_files

_CHECKPOINTS = flags.DEFINE_list("checkpoints", ["tiny-dlm", "tiny-moe-dlm", "tiny-uniform-dlm", "tiny-arm"],
                                 f"Checkpoints ([label=]DIR or {', '.join(checkpoints.NAMES)}).")
_N_PROMPTS = flags.DEFINE_integer("n_prompts", 8, "Prompts per model (0 = the whole task).")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 8, "Prompts per sampler call (results do not depend on it).")
_LENS_STEPS = flags.DEFINE_string("lens_steps", "all", "Steps (model calls) the lens reads: all, every:K, or "
                                  "comma-separated step numbers.")
_LENS_TOP_K = flags.DEFINE_integer("lens_top_k", 5, "Most probable tokens the lens keeps at each step, row and "
                                   "position (--top_k is the sampling filter).")

NOT_READ = -2
"""first_top1 of a (step, position) not read; −1: read, but the final token is top-1 at no row."""


def parse_steps(text: str) -> Steps:
  """--lens_steps as `Steps`: "all", "every:K" or "0,4,8" (a one-line UserError otherwise)."""
  if text.strip() == "all":
    return Steps.every_step()
  every = text.strip().startswith("every:")
  try:
    numbers = [int(s) for s in (text.strip()[len("every:"):] if every else text).split(",")]
    if every and len(numbers) != 1:
      raise ValueError
  except ValueError:
    raise cli.UserError(f"--lens_steps={text}: expected all, every:K (K >= 1) or comma-separated step numbers "
                        ">= 0") from None
  try:
    return Steps.every(numbers[0]) if every else Steps.at_steps(*numbers)
  except ValueError as error:
    raise cli.UserError(f"--lens_steps={text}: {error}") from None


@dataclasses.dataclass(frozen=True)
class Settings:
  """Everything that defines a logit_lens run (recorded in run.json; flags of the same names)."""

  checkpoints: tuple[str, ...]
  n_prompts: int
  batch_size: int
  lens_steps: str
  lens_top_k: int
  task: TaskSettings
  decode: DecodeSettings
  numerics: Numerics

  def __post_init__(self):
    flag_checks.checkpoints_given(self.checkpoints)
    flag_checks.positive(batch_size=self.batch_size, lens_top_k=self.lens_top_k)
    flag_checks.item_count(n_prompts=self.n_prompts)
    size_limits.check(n_prompts=self.n_prompts, batch_size=self.batch_size, lens_top_k=self.lens_top_k)
    parse_steps(self.lens_steps)

  @property
  def steps(self) -> Steps:
    return parse_steps(self.lens_steps)

  def check_model(self, model: checkpoint_bundle.Model) -> None:
    if self.lens_top_k > model.config.vocab_size:
      raise cli.UserError(f"--lens_top_k={self.lens_top_k}: {model.label} has {model.config.vocab_size} tokens")


def _plan_check(settings: Settings, model: checkpoint_bundle.Model, values: dict, batch: item_batches.Batch,
                runtime: devices.Runtime) -> None:
  """Prints the bytes the lens captures of one sampler call take and refuses a plan over the budget or one
  that keeps no step of this run; abstract (the weights are not read, nothing is computed)."""
  hooks = logit_lens.lens_hooks(model.config, settings.steps, settings.lens_top_k)
  b = batch.prompts.ids.shape[0]
  s = batch.prompts.ids.shape[1] + values["gen_length"]
  numerics = settings.numerics

  def run():
    params = init_params(model.config, jax.random.key(0), numerics.weight_dtype)  # abstract under eval_shape
    abstract = dataclasses.replace(model, params=params)
    targets = CaptureValues(targets=jnp.zeros((b, s), jnp.int32))
    sample = decoding.sampler(abstract, values, batch.prompts, runtime, numerics, key=batch.key)
    return sample(hooks=hooks, hook_values=hook_values(hooks, model.config, b, s, captures={0: targets, 1: targets}))

  shrink = "use fewer --lens_steps (every:K), a smaller --lens_top_k or --batch_size"
  try:
    capture_budget.check(run, f"{model.label} ({len(hooks.capture_names(model.config))} sites)", shrink)
  except ValueError as error:
    raise cli.UserError(f"--lens_steps={settings.lens_steps}: {model.label}: {error}") from None


def _batches(settings: Settings, model: checkpoint_bundle.Model, runtime: devices.Runtime, done):
  todo = items.load_items(items.task_name(settings.task.task, model.record), settings.n_prompts,
                          settings.task.data_seed)
  prompt_set = prompts.encode(model, todo)
  return todo, item_batches.batches(todo, prompt_set, settings.batch_size, settings.decode.seed, runtime, done)


def answer_positions(model: checkpoint_bundle.Model, generated: np.ndarray) -> np.ndarray:
  """[B, G] bool: the generated positions up to and including the first stop id of each row."""
  stops = np.isin(generated, list(prompts.stop_ids(model)))
  first = np.where(stops.any(1), np.argmax(stops, axis=1), generated.shape[1] - 1)
  return np.arange(generated.shape[1])[None, :] <= first[:, None]


def top_tokens_read(lens: logit_lens.LogitLens, row: int) -> tuple[np.ndarray, np.ndarray]:
  """The lens's top-k tokens of one batch row at each generated position's first and last step read:
  two [G, R, k] int arrays, −1 at positions never read."""
  lp = lens.prompt_length
  read = lens.selected[:, row, lp:]  # [n, G]
  tokens = lens.top_tokens[:, :, row, lp:]  # [n, R, G, k]
  positions = np.arange(read.shape[1])
  first = np.argmax(read, axis=0)
  last = read.shape[0] - 1 - np.argmax(read[::-1], axis=0)
  never = ~read.any(0)[:, None, None]
  return tuple(np.where(never, -1, tokens[at, :, positions]) for at in (first, last))


def analyse_row(model: checkpoint_bundle.Model, item, lens: logit_lens.LogitLens, row: int) -> dict:
  """One prompt's lens: per kept step the count read and per row the sums of p, rank and top-1; the first
  row with the final token top-1 at every (step, position); the top tokens at each position's first and
  last step read."""
  lp = lens.prompt_length
  sel = lens.selected[:, row]  # [n, S]
  first = np.where(sel, lens.first_top1_row()[:, row], NOT_READ)
  generated = lens.tokens[row, lp:]
  top_first, top_last = top_tokens_read(lens, row)
  return {
      "model": model.label, "item": item.id, "steps": lens.steps, "rows": list(lens.rows), "count": sel.sum(-1),
      "probability_sum": (lens.probability[:, :, row] * sel[:, None]).sum(-1).round(6),
      "rank_sum": (lens.rank[:, :, row] * sel[:, None]).sum(-1),
      "top1_count": ((lens.rank[:, :, row] == 0) & sel[:, None]).sum(-1),
      "first_top1": first[:, lp:], "top_tokens_first_read": top_first, "top_tokens_last_read": top_last,
      "tokens": generated,
      "completion": prompts.completion(model, generated)[1],
  }


def run_model(settings: Settings, model, runtime: devices.Runtime, log: run_dir.ResultsLog) -> dict:
  """Decodes and reads the lens of the model's prompts not done yet; returns its metadata for the report."""
  values = decode_settings.model_settings(settings.decode, model)
  done = lambda item: log.done(model=model.label, item=item.id)
  todo, batches = _batches(settings, model, runtime, done)
  meter = progress.Progress(f"{model.label} prompts", len(todo), sum(map(done, todo)))
  for batch in batches:
    sample = decoding.sampler(model, values, batch.prompts, runtime, settings.numerics, key=batch.key)
    lp = batch.prompts.ids.shape[1]

    def checked(**hooks):
      trace = sample(**hooks)
      decoding.check_finite(trace, [f"{model.label} batch row {r}" for r in range(batch.prompts.ids.shape[0])])
      return trace

    lens = logit_lens.logit_lens(checked, model.config, steps=settings.steps, k=settings.lens_top_k)
    lens = lens.only(answer_positions(model, lens.tokens[:, lp:]))
    for row, item in enumerate(batch.items):
      if not done(item):
        meter.update(int(log.append(analyse_row(model, item, lens, row))))
  return {"label": model.label, "directory": progress.display_path(model.directory), "sampler": model.sampler,
          "rows": list(logit_lens.row_names(model.config)), "settings": values,
          "token_text": [model.tokenizer.id_to_token(i) for i in range(model.config.vocab_size)]}


def aggregate(rows: list[dict]) -> dict:
  """The records of one model pooled over prompts: per step (the union of their steps, sorted) the count
  read and per lens row the mean p(final token), mean rank and top-1 fraction ([n, R], NaN where nothing
  was read), and over every (step, position) read the same per row ([R])."""
  steps = sorted({int(s) for r in rows for s in r["steps"]})
  index = {s: i for i, s in enumerate(steps)}
  n_rows = len(rows[0]["rows"])
  count = np.zeros(len(steps))
  sums = {k: np.zeros((len(steps), n_rows)) for k in ("probability_sum", "rank_sum", "top1_count")}
  for r in rows:
    at = [index[int(s)] for s in r["steps"]]
    np.add.at(count, at, np.asarray(r["count"], np.float64))
    for k in sums:
      np.add.at(sums[k], at, np.asarray(r[k], np.float64))
  with np.errstate(invalid="ignore", divide="ignore"):
    per_step = {name: sums[key] / count[:, None] for name, key in
                (("mean_probability", "probability_sum"), ("mean_rank", "rank_sum"), ("top1_fraction", "top1_count"))}
    overall = {name: sums[key].sum(0) / count.sum() for name, key in
               (("mean_probability", "probability_sum"), ("mean_rank", "rank_sum"), ("top1_fraction", "top1_count"))}
  return {"steps": steps, "count": count.astype(int), "per_step": per_step, "overall": overall,
          "pairs": int(count.sum())}


def first_rows(rows: list[dict], names: list[str], kept: np.ndarray | None = None, last_read: bool = False) -> dict:
  """Over every (step, position) read: the share whose final token is top-1 first at each lens row (by its
  name), and at no row ("never"), and the pairs counted; kept: [V] bool, only the positions whose final
  token id it keeps (None: every position); last_read: only each position's last step read (the step that
  decodes it, with --lens_steps=all)."""
  firsts = []
  for r in rows:
    first = np.asarray(r["first_top1"])
    if last_read:
      read = first != NOT_READ
      last = first.shape[0] - 1 - np.argmax(read[::-1], axis=0)
      first = np.where(read.any(0), first[last, np.arange(first.shape[1])], NOT_READ)[None]
    if kept is not None:
      first = first[:, kept[np.asarray(r["tokens"])]]
    firsts.append(first.ravel())
  first = np.concatenate(firsts)
  read = first[first != NOT_READ]
  share = lambda i: float(np.mean(read == i)) if read.size else float("nan")
  return {"never": share(-1), **{name: share(i) for i, name in enumerate(names)}, "pairs": int(read.size)}


def number_tokens(token_text: list[str | None]) -> np.ndarray:
  """[V] bool: tokens whose text (without a leading space marker) is all digits."""
  return np.asarray([bool(t) and t.lstrip("Ġ▁ ").isdigit() for t in token_text])


def _token_label(meta: dict, token: int) -> str:
  text = meta["token_text"][token] if 0 <= token < len(meta["token_text"]) else None
  return figure_axes.token_text(text)


def _figures(out: str, meta: dict, pooled: dict, example: dict) -> None:
  label, rows = meta["label"], meta["rows"]
  model_dir = os.path.join(out, label)
  heat = lens_plots.step_layer_heatmap(pooled["per_step"]["mean_probability"], pooled["steps"], rows,
                                       f"{label}: mean p(final decoded token) under the logit lens, per step and "
                                       f"layer\n(positions still undecided; {pooled['pairs']} (step, position) "
                                       "pairs pooled over prompts)", "mean p(final token)")
  atomic_files.save_figure(heat, os.path.join(model_dir, "lens_probability.png"))
  first = np.asarray(example["first_top1"])
  read_at = np.flatnonzero((first != NOT_READ).any(0))
  ran = np.flatnonzero((first != NOT_READ).any(1))
  tokens = [f"{p} {_token_label(meta, int(example['tokens'][p]))}" for p in read_at]
  grid = lens_plots.first_top1_grid(first[np.ix_(ran, read_at)], [example["steps"][i] for i in ran], rows, tokens,
                                    f"{label}, prompt {example['item']}: first layer at which the final token is "
                                    f"top-1, per step and position\nanswer: {example['completion'][:80]!r}")
  atomic_files.save_figure(grid, os.path.join(model_dir, "example_first_top1.png"))


def write_report(settings: Settings, out: str, metas: list[dict], records: list[dict], wall_s: float) -> str:
  """Writes the figures, summary.json and summary.md; returns the markdown."""
  lines = ["# The logit lens per denoising step: `experiments.logit_lens`", "",
           "Each layer's residual stream through the final norm and LM head at the positions still undecided at "
           f"each kept step (--lens_steps={settings.lens_steps}), read at the token finally decoded there; only "
           f"the answer and the token ending it. Wall time {wall_s:.0f}s.", "",
           "Top-1 fraction of the final token over every (step, position) read, per lens row (embed = token "
           "embeddings; L{l} = block l's output; the last is the model's own prediction):", ""]
  summary, table, firsts = {}, [], []
  for meta in metas:
    rows = [r for r in records if r["model"] == meta["label"]]
    if not rows:
      continue
    pooled = aggregate(rows)
    names = [f"L{r}" if r.isdigit() else r for r in meta["rows"]]
    shares = first_rows(rows, names)
    numbers = number_tokens(meta["token_text"])
    by_kind = {"numbers": first_rows(rows, names, numbers), "other tokens": first_rows(rows, names, ~numbers),
               "numbers, last step read": first_rows(rows, names, numbers, last_read=True),
               "other tokens, last step read": first_rows(rows, names, ~numbers, last_read=True)}
    first_step = pooled["per_step"]["top1_fraction"][int(np.argmax(pooled["count"] > 0))]  # first step read
    summary[meta["label"]] = {"rows": meta["rows"], "steps": pooled["steps"], "count": pooled["count"],
                              "pairs": pooled["pairs"], "prompts": len(rows), "per_step": pooled["per_step"],
                              "overall": pooled["overall"], "first_top1_row_share": shares,
                              "first_top1_row_share_by_token": by_kind,
                              "top1_fraction_first_step_read": first_step}
    table.append(f"| {meta['label']} | {meta['sampler']} | {len(rows)} | {pooled['pairs']} | "
                 + ", ".join(f"{names[i]} {v:.2f}" for i, v in enumerate(pooled["overall"]["top1_fraction"]))
                 + f" | {pooled['overall']['mean_probability'][-1]:.3f} | {first_step[-1]:.2f} | "
                 + f"{shares['never']:.2f} |")
    firsts.append(f"| {meta['label']} | " + " | ".join(
        f"({s['pairs']}) " + ", ".join(f"{n} {s[n]:.2f}" for n in ["never", *names]) for kind, s in
        by_kind.items()) + " |")
    _figures(out, meta, pooled, rows[0])
  lines += ["| model | sampler | prompts | (step, position) pairs | top-1 fraction per row | mean p(final) at the "
            "last row | last-row top-1 at the first step read | top-1 at no row |", "|---|---|---|---|---|---|---|---|",
            *table, "", "The row at which the final token first becomes top-1 (share of the (step, position) pairs "
            "read; pairs in brackets), for number tokens and the others, at every step read and at each "
            "position's last step read (the step that decodes it, with --lens_steps=all):", "",
            "| model | numbers | other tokens | numbers, last step read | other tokens, last step read |",
            "|---|---|---|---|---|",
            *firsts, ""]
  for label in summary:
    lines.append(f"- [{label}/lens_probability.png]({label}/lens_probability.png), "
                 f"[{label}/example_first_top1.png]({label}/example_first_top1.png)")
  return summary_files.write(out, {"models": [{k: v for k, v in m.items() if k != "token_text"} for m in metas],
                                   "summary": summary, "wall_s": wall_s}, lines)


def main(argv):
  del argv
  shared = analysis_flags.from_flags("logit_lens", _CHECKPOINTS)
  models = shared.prepare_models()
  runtime = devices.init_runtime(shared.runtime)  # before anything touches a JAX backend (the numerics)
  settings = Settings(checkpoints=shared.checkpoints, n_prompts=_N_PROMPTS.value, batch_size=_BATCH_SIZE.value,
                      lens_steps=_LENS_STEPS.value, lens_top_k=_LENS_TOP_K.value, task=shared.task,
                      decode=shared.decode, numerics=numerics_flags.from_flags(shared.runtime))
  for model in models:
    settings.check_model(model)
    values = decode_settings.model_settings(shared.decode, model)
    _, batches = _batches(settings, model, runtime, lambda item: False)
    _plan_check(settings, model, values, next(batches), runtime)
  runs = model_runs.run_models(shared.output, settings, models, runtime, shared.task.task, run_model)
  if runs is not None:
    progress.summary_banner(runs.out.path, write_report(settings, runs.out.path, runs.metas, runs.log.records,
                                                        runs.seconds))


if __name__ == "__main__":
  cli.run(main)
