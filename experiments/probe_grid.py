r"""Linear probes over layers × steps on a trajectory dataset (`experiments.export_trajectories`).

  python -m experiments.probe_grid --dataset=results/export_trajectories/tiny-dlm
  python -m experiments.probe_grid --dataset=DIR --targets=correct --position_classes=masked --step_bin=4

For each target, position class, captured site (a column blocks.{l}.<kind> of the dataset) and bin of
--step_bin steps, a probe is fitted on the rows of the training items and scored on the held-out items
(--test_fraction of the items, fixed --seed; `dlm_jax.analysis.probe_cells`), with a 95% percentile
bootstrap interval over --n_boot resamples of the held-out items:
  progress      ridge regression (--ridge_l2) of the denoising progress step / (steps run − 1), all steps of
                the class pooled (a step bin holds one progress value): R², sites × position classes; beside
                it the control "position only": the same ridge on a one-hot of the position alone
  final_token   softmax logistic regression (--l2) over the final tokens found in the dataset: accuracy
  decoded_next  logistic regression: does a masked position hold a token from the next step on? AUC
  correct       logistic regression of the item's answer correctness (as scored by the export) on the mean
                of the site over the item's positions of the class at each step (one row per item and step):
                AUC
The summary names, per grid and site, the first step bin from which on every bin's interval lies above chance
(AUC 0.5, R² 0, the majority class's accuracy).
A target with one class in the whole selection (every answer correct, decoded_next without masked positions)
is refused in one line before any fit; a cell whose training rows have one class is left blank (its reason
in results.jsonl).

Outputs in --output_dir (default results/probe_grid): results.jsonl (one line per cell, resumable like the
other binaries; run.json records the settings and the dataset's manifest identity), summary.json (grids of
value, interval low and high), summary.md and one figure per target and position class
(<target>_<class>.png; progress.png).
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
from absl import flags

from dlm_jax.analysis import probe_cells
from dlm_jax.io.trajectory_dataset import TrajectoryDataset, TrajectoryDatasetError, open_trajectory_dataset
from experiments.common import atomic_files, cli, flag_checks, output_flags, progress, run_dir
from experiments.reports import probe_plots, summary_files

TARGETS = ("progress", "final_token", "decoded_next", "correct")
KIND = {"progress": "regression", "final_token": "multiclass", "decoded_next": "binary", "correct": "binary"}

_DATASET = flags.DEFINE_string("dataset", None, "A trajectory dataset directory (experiments.export_trajectories).")
_TARGETS = flags.DEFINE_list("targets", list(TARGETS), f"Probe targets: some of {', '.join(TARGETS)}.")
_SITES = flags.DEFINE_list("sites", [], "Site columns probed (default: every captured site of the dataset).")
_CLASSES = flags.DEFINE_list("position_classes", ["masked", "decoded"], "Position classes (rows) probed.")
_STEP_BIN = flags.DEFINE_integer("step_bin", 1, "Steps per bin of the layer × step grids.")
_TEST_FRACTION = flags.DEFINE_float("test_fraction", 0.25, "Share of the items held out.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the split, the row sample and the bootstrap.")
_L2 = flags.DEFINE_float("l2", 1.0, "L2 penalty of the logistic probes (scikit-learn C = 1 / l2).")
_RIDGE_L2 = flags.DEFINE_float("ridge_l2", 1.0, "L2 penalty of the ridge probes (scikit-learn alpha).")
_MAX_TRAIN_ROWS = flags.DEFINE_integer("max_train_rows", 20000, "Most training rows per cell (a fixed sample).")
_N_BOOT = flags.DEFINE_integer("n_boot", 200, "Bootstrap resamples of the held-out items per cell.")


@dataclasses.dataclass(frozen=True)
class Settings:
  """Everything that defines a probe grid (recorded in run.json)."""

  dataset: str
  targets: tuple[str, ...]
  sites: tuple[str, ...]
  position_classes: tuple[str, ...]
  step_bin: int
  test_fraction: float
  seed: int
  l2: float
  ridge_l2: float
  max_train_rows: int
  n_boot: int

  def __post_init__(self):
    if not self.dataset:
      raise cli.UserError("--dataset is required: a directory written by experiments.export_trajectories")
    bad = [t for t in self.targets if t not in TARGETS]
    if bad or not self.targets:
      raise cli.UserError(f"--targets={','.join(self.targets)}: expected some of {', '.join(TARGETS)}")
    flag_checks.positive(step_bin=self.step_bin, max_train_rows=self.max_train_rows, n_boot=self.n_boot)
    flag_checks.above_zero(l2=self.l2, ridge_l2=self.ridge_l2)
    if not 0 < self.test_fraction < 1:
      raise cli.UserError(f"--test_fraction={self.test_fraction}: expected a share strictly between 0 and 1")
    if not self.position_classes:
      raise cli.UserError("--position_classes is empty; name at least one (e.g. masked)")


def open_dataset(settings: Settings) -> tuple[TrajectoryDataset, tuple[str, ...]]:
  """The dataset and the sites probed; one-line UserErrors for a bad dataset, site, class or one-class target."""
  try:
    ds = open_trajectory_dataset(settings.dataset)
  except TrajectoryDatasetError as error:
    raise cli.UserError(f"--dataset: {error}") from None
  codes = ds.manifest["settings"].get("position_class_codes", {})
  exported = [c for c in ds.manifest["settings"].get("settings", {}).get("position_classes", [])]
  for name in settings.position_classes:
    if name not in codes or name not in exported:
      raise cli.UserError(f"--position_classes: {name} is not among the dataset's exported classes "
                          f"({', '.join(exported)})")
  captured = tuple(c for c in ds.columns if c.startswith("blocks.") or c in ("hook_embed", "ln_final.hook_normalized"))
  sites = settings.sites or captured
  for site in sites:
    if site not in captured:
      raise cli.UserError(f"--sites: {site} is not a captured site of the dataset ({', '.join(captured)})")
  klass = ds.column("position_class")
  chosen = np.isin(klass, [codes[c] for c in settings.position_classes])
  for target in settings.targets:
    column = {"progress": "progress", "final_token": "final_token", "decoded_next": "decoded_next",
              "correct": "correct"}[target]
    values = np.unique(ds.column(column)[chosen])
    if len(values) < 2:
      what = "value" if target == "progress" else "class"
      raise cli.UserError(f"--targets={target}: every selected row of the dataset has the one {what} "
                          f"{values[0] if len(values) else 'none'} (position classes "
                          f"{','.join(settings.position_classes)}); a probe needs at least two")
  return ds, sites


def _pooled(features: np.ndarray, items: np.ndarray, steps: np.ndarray):
  """Mean features per (item, step): (features [M, D], items [M], steps [M])."""
  keys, inverse = np.unique(np.stack([items, steps], 1), axis=0, return_inverse=True)
  inverse = inverse.reshape(-1)
  sums = np.zeros((len(keys), features.shape[1]), np.float64)
  np.add.at(sums, inverse, features)
  counts = np.bincount(inverse, minlength=len(keys))
  return (sums / counts[:, None]).astype(np.float32), keys[:, 0], keys[:, 1]


def _cells(settings: Settings, ds: TrajectoryDataset, target: str, site: str, rows: np.ndarray,
           test_items: np.ndarray, token_classes: np.ndarray, done):
  """Yields (step_bin, cell result) of one target, site and class over the rows `rows` of the class, skipping
  the step bins b with done(b) (progress: one cell, bin −1)."""
  items = ds.column("item")[rows]
  steps = ds.column("step")[rows]
  features = np.asarray(ds.column(site)[rows], np.float32).reshape(len(rows), -1)
  kind = KIND[target]
  common = dict(l2=settings.ridge_l2 if kind == "regression" else settings.l2,
                max_train_rows=settings.max_train_rows, n_boot=settings.n_boot, seed=settings.seed)
  if target == "progress":
    if not done(-1):
      y = ds.column("progress")[rows]
      cell = probe_cells.probe_cell(features, y, items, kind, test_items, **common)
      positions = ds.column("position")[rows]
      one_hot = (positions[:, None] == np.unique(positions)[None]).astype(np.float32)
      control = probe_cells.probe_cell(one_hot, y, items, kind, test_items, **common)
      yield -1, dict(cell, position_only={"value": control["value"], "ci": control["ci"]})
    return
  if target == "correct":
    features, items, steps = _pooled(features, items, steps)
    per_item = dict(zip(ds.column("item")[rows], ds.column("correct")[rows]))
    y = np.asarray([per_item[i] for i in items], np.int64)
  elif target == "final_token":
    y = np.searchsorted(token_classes, ds.column("final_token")[rows])
  else:
    y = ds.column("decoded_next")[rows].astype(np.int64)
  bins = steps // settings.step_bin
  for b in np.unique(bins):
    if done(int(b)):
      continue
    at = bins == b
    cell = probe_cells.probe_cell(features[at], y[at], items[at], kind, test_items,
                                  n_classes=len(token_classes) if kind == "multiclass" else 2, **common)
    yield int(b), dict(cell, steps=[int(s) for s in np.unique(steps[at])])


def run_grid(settings: Settings, ds: TrajectoryDataset, sites: tuple[str, ...], log: run_dir.ResultsLog) -> None:
  """Fits every cell not in `log` yet and appends it."""
  codes = ds.manifest["settings"]["position_class_codes"]
  klass_column = ds.column("position_class")
  test_items = probe_cells.split_items(ds.column("item"), settings.test_fraction, settings.seed)
  token_classes = np.unique(ds.column("final_token")[np.isin(klass_column, [codes[c] for c in
                                                                            settings.position_classes])])
  units = [(t, c, s) for t in settings.targets for c in settings.position_classes for s in sites]
  meter = progress.Progress("probe grids (target, class, site)", len(units))
  for target, klass, site in units:
    rows = np.flatnonzero(klass_column == codes[klass])
    if len(rows):
      done = lambda b, t=target, c=klass, s=site: log.done(target=t, position_class=c, site=s, step_bin=b)
      for step_bin, cell in _cells(settings, ds, target, site, rows, test_items, token_classes, done):
        log.append({"target": target, "position_class": klass, "site": site, "step_bin": step_bin,
                    "steps": "all", **cell})
    meter.update(1, f"{target} {klass} {site}")


def _site_label(site: str) -> str:
  return f"L{site.split('.')[1]} {site.split('.', 2)[2]}" if site.startswith("blocks.") else site


def write_report(settings: Settings, out: str, sites: tuple[str, ...], records: list[dict], model: dict) -> str:
  """Writes the figures, summary.json and summary.md; returns the markdown."""
  labels = [_site_label(s) for s in sites]
  summary: dict = {"dataset": settings.dataset, "model": model, "interval": "95% percentile bootstrap over "
                   f"{settings.n_boot} resamples of the held-out items", "grids": {}}
  lines = ["# Linear probes over layers × steps: `experiments.probe_grid`", "",
           f"Dataset {settings.dataset}; held-out share {settings.test_fraction} of the items (seed {settings.seed}); "
           f"intervals: {summary['interval']}.", ""]
  for target in settings.targets:
    metric = probe_cells.METRICS[KIND[target]]
    if target == "progress":
      grid = np.full((3, len(sites), len(settings.position_classes)), np.nan)
      control = {}
      for r in records:
        if r["target"] == target and r["site"] in sites and r["position_class"] in settings.position_classes:
          at = (sites.index(r["site"]), settings.position_classes.index(r["position_class"]))
          grid[:, at[0], at[1]] = [r["value"], *r["ci"]]
          control[r["position_class"]] = r["position_only"]
      summary["grids"][target] = {"metric": metric, "rows": list(sites), "columns": list(settings.position_classes),
                                  "value": grid[0], "low": grid[1], "high": grid[2], "position_only": control}
      fig = probe_plots.grid_figure(grid[0], labels, list(settings.position_classes),
                                    title=f"denoising progress from a linear (ridge) probe: held-out {metric}",
                                    xlabel="position class", ylabel="site (layer)", metric=f"held-out {metric}",
                                    vmin=0.0, vmax=1.0)
      atomic_files.save_figure(fig, os.path.join(out, "progress.png"))
      lines += ["## progress (R², held-out items; 95% interval)", "",
                "| site | " + " | ".join(settings.position_classes) + " |",
                "|---|" + "---|" * len(settings.position_classes)]
      lines += [f"| {labels[i]} | " + " | ".join(f"{grid[0, i, j]:.3f} [{grid[1, i, j]:.3f}, {grid[2, i, j]:.3f}]"
                                               for j in range(len(settings.position_classes))) + " |"
                for i in range(len(sites))]
      lines.append("| position only (control) | " + " | ".join(
          f"{control[c]['value']:.3f} [{control[c]['ci'][0]:.3f}, {control[c]['ci'][1]:.3f}]" if c in control else "–"
          for c in settings.position_classes) + " |")
      lines.append("")
      continue
    for klass in settings.position_classes:
      cells = [r for r in records if r["target"] == target and r["position_class"] == klass and r["site"] in sites]
      if not cells:
        continue
      bins = sorted({r["step_bin"] for r in cells})
      grid = np.full((3, len(sites), len(bins)), np.nan)
      for r in cells:
        grid[:, sites.index(r["site"]), bins.index(r["step_bin"])] = [r["value"], *r["ci"]]
      present = {r["step_bin"]: r["steps"] for r in cells}
      columns = [str(present[b][0]) if len(present[b]) == 1 else f"{present[b][0]}-{present[b][-1]}" for b in bins]
      if np.all(np.isnan(grid[0])):
        reasons = sorted({r["skipped"] for r in cells if r["skipped"]})
        lines += [f"## {target} at {klass} positions: no probe ({'; '.join(reasons)})", ""]
        continue
      first = {site: probe_cells.first_reading_bin([r for r in cells if r["site"] == site]) for site in sites}
      summary["grids"][f"{target}/{klass}"] = {"metric": metric, "rows": list(sites), "step_bins": columns,
                                               "value": grid[0], "low": grid[1], "high": grid[2],
                                               "above_chance_from_bin": first}
      fig = probe_plots.grid_figure(grid[0], labels, columns, title=f"{target} from a linear probe at {klass} "
                                    f"positions: held-out {metric}", xlabel="step (model call)",
                                    ylabel="site (layer)", metric=f"held-out {metric}",
                                    vmin=0.0 if metric != "auc" else 0.3, vmax=1.0)
      atomic_files.save_figure(fig, os.path.join(out, f"{target}_{klass}.png"))
      lines += [f"## {target} at {klass} positions ({metric}, held-out items)", "",
                "| site | best step bin: value [95% interval] | above chance from step bin on |",
                "|---|---|---|"]
      for i, site in enumerate(sites):
        if np.all(np.isnan(grid[0, i])):
          lines.append(f"| {labels[i]} | – | – |")
          continue
        j = int(np.nanargmax(grid[0, i]))
        lines.append(f"| {labels[i]} | {columns[j]}: {grid[0, i, j]:.3f} [{grid[1, i, j]:.3f}, {grid[2, i, j]:.3f}] | "
                     f"{'none' if first[site] is None else columns[bins.index(first[site])]} |")
      lines.append("")
  return summary_files.write(out, summary, lines)


def main(argv):
  del argv
  output = output_flags.from_flags("probe_grid")
  settings = Settings(dataset=progress.display_path(_DATASET.value) if _DATASET.value else "",
                      targets=tuple(_TARGETS.value), sites=tuple(_SITES.value),
                      position_classes=tuple(_CLASSES.value), step_bin=_STEP_BIN.value,
                      test_fraction=_TEST_FRACTION.value, seed=_SEED.value, l2=_L2.value, ridge_l2=_RIDGE_L2.value,
                      max_train_rows=_MAX_TRAIN_ROWS.value, n_boot=_N_BOOT.value)
  ds, sites = open_dataset(settings)
  model = {"model": ds.manifest["model"], "export": ds.manifest["settings"]["settings"]}
  out = run_dir.RunDir(output.output_dir, {"settings": dataclasses.asdict(settings), "dataset": model},
                       overwrite=output.overwrite, inputs=[settings.dataset])
  log = run_dir.ResultsLog(out, "results.jsonl", ("target", "position_class", "site", "step_bin"),
                           output.max_items_this_run)
  try:
    run_grid(settings, ds, sites, log)
  except run_dir.ItemBudget:
    return
  out.ensure()
  progress.summary_banner(out.path, write_report(settings, out.path, sites, log.records, model))


if __name__ == "__main__":
  cli.run(main)
