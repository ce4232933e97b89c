r"""Activation patching across denoising steps: when and where does a diffusion LM compute its answer?

  python -m experiments.activation_patching                  # tiny-dlm, tiny-moe-dlm and tiny-arm
  python -m experiments.activation_patching --checkpoints=tiny-dlm --n_pairs=16 --sites=hook_resid_pre \
      --patch_steps=0,4,8,12

Pairs. Problem i of the synthetic test split (the clean prompt) and the same problem with ONE operand of its
question changed (the corrupted prompt; `dlm_jax.tasks.synthetic_pairs`: the answer changes, every count stays
in the task's range). Pairs whose two prompts or answers tokenize to different lengths are skipped and counted.
Prompts are in the models' training layout, so the reference answer starts at the first generated position.

Metric. The logit difference m = logit[clean answer token] − logit[corrupted answer token] at the answer
position — the first position after the last #### where the two reference answers differ (the final number,
one token here) — read from the logits of the step at which that position is decoded in the run at hand
(`ln_final.hook_normalized` captured with `Steps.decoded()`, through `dlm_jax.model.lm_head`; for a shifted
model, the ARM, whose logits of position p come from position p − 1, the capture is at every step and read at
p − 1 at the decode step). For the ARM a step is one generated token.

Patching. The clean run's site is captured at every step and layer; each grid cell patches it into the
corrupted run at one (layer, step), every position, with `Edit(site, "replace", source="values")`: cells are
rows of one compiled program with per-row windows and layer masks (`dlm_jax.analysis.patching_grid`). Sites:
layer × step grids for the [D] sites (default hook_resid_pre, hook_attn_out, hook_mlp_out), layer × head grids
for attn.hook_z (each head patched over the steps of a --head_window window; default all steps). Effects are
normalized per pair (clean run = 1, corrupted run = 0; `PatchingResult`), means and standard errors over pairs.

Attribution patching (diffusion models, exact decoding): per step s, the gradient of step s's own metric with
respect to each layer's site, times (clean − corrupted) activation (`dlm_jax.analysis.attribution`), compared
with the immediate effect of real patching (the same cell, the metric read from step s's own logits).

Outputs in --output_dir (default results/activation_patching): results.jsonl (one line per model and pair:
raw metrics per cell), summary.json (means, standard errors, peaks, the attribution-vs-patching correlation),
summary.md, and per model <model>/<site>.png heatmaps, <model>/heads.png, <model>/attribution.png. run.json
records the settings; a rerun resumes. --capture_budget_gb bounds every capture plan, checked before any model
work.
"""

from __future__ import annotations

import dataclasses
import functools

from absl import flags

from dlm_jax.instrument import sites
from dlm_jax.sampling import registry
from dlm_jax.session import checkpoint_bundle, decode_settings, size_limits
from dlm_jax.session.decode_settings import DecodeSettings
from experiments.common import (analysis_flags, capture_budget, checkpoints, cli, devices, flag_checks, model_runs,
                                numerics, numerics_flags, patching_pairs, progress, run_dir)
from experiments.common.items import TaskSettings
from experiments.common.numerics import Numerics
from experiments.common.patching_runs import PatchRunner
from experiments.reports import patching_report

GRID_SITES = ("hook_resid_pre", "hook_attn_out", "hook_resid_mid", "hook_mlp_out", "hook_resid_post")
HEAD_SITES = ("attn.hook_z",)
SAMPLERS = tuple(name for name, s in registry.SAMPLERS.items() if not (s.block_queries or s.self_conditioning))
"""The samplers whose every step reads a fixed answer position of one sequence: not block diffusion (its steps
see only their block) nor DiffusionGemma (uniform-state canvases, no fixed answer position at a step)."""

_CHECKPOINTS = flags.DEFINE_list("checkpoints", ["tiny-dlm", "tiny-moe-dlm", "tiny-arm"],
                                 f"Checkpoints ([label=]DIR or {', '.join(checkpoints.NAMES)}).")
_N_PAIRS = flags.DEFINE_integer("n_pairs", 8, "Problems of the synthetic test split made into pairs.")
_PAIRS_PER_CALL = flags.DEFINE_integer("pairs_per_call", 8, "Pairs per sampler call (a layer × step call has "
                                       "pairs × layers rows; results do not depend on it).")
_SITES = flags.DEFINE_list("sites", ["hook_resid_pre", "hook_attn_out", "hook_mlp_out", "attn.hook_z"],
                           f"Sites to patch: layer × step grids for {', '.join(GRID_SITES)}; layer × head grids "
                           f"for {', '.join(HEAD_SITES)}.")
_PATCH_STEPS = flags.DEFINE_list("patch_steps", ["all"], "Steps of the layer × step grids: all, or step indices.")
_HEAD_WINDOW = flags.DEFINE_integer("head_window", 0, "Steps per window of the layer × head grids (0: one window "
                                    "of every step).")
_ATTRIBUTION = flags.DEFINE_bool("attribution", True, "Compare attribution patching with real patching (diffusion "
                                 "models in exact decoding).")


@dataclasses.dataclass(frozen=True)
class Settings:
  """Everything that defines an activation_patching run (recorded in run.json; flags of the same names)."""

  checkpoints: tuple[str, ...]
  n_pairs: int
  pairs_per_call: int
  sites: tuple[str, ...]
  patch_steps: tuple[int, ...] | None
  head_window: int
  attribution: bool
  task: TaskSettings
  decode: DecodeSettings
  numerics: Numerics

  def __post_init__(self):
    flag_checks.checkpoints_given(self.checkpoints)
    flag_checks.positive(n_pairs=self.n_pairs, pairs_per_call=self.pairs_per_call)
    size_limits.check(n_prompts=self.n_pairs, batch_size=self.pairs_per_call)
    if not self.sites:
      raise cli.UserError("--sites is empty; give at least one site")
    for site in self.sites:
      try:
        kind, layer = sites.parse(site)
      except ValueError as error:
        raise cli.UserError(f"--sites: {error}") from None
      if layer is not None or kind not in GRID_SITES + HEAD_SITES:
        raise cli.UserError(f"--sites={site}: expected one of {', '.join(GRID_SITES + HEAD_SITES)} (a site kind, "
                            "every layer)")
    if len(set(self.sites)) != len(self.sites):
      raise cli.UserError(f"--sites={','.join(self.sites)} names a site twice")
    if self.patch_steps is not None and (not self.patch_steps or min(self.patch_steps) < 0):
      raise cli.UserError("--patch_steps is empty or negative; give all or step indices >= 0")
    if self.head_window < 0:
      raise cli.UserError(f"--head_window={self.head_window}: expected >= 0 (0 = every step in one window)")
    if self.task.task not in ("auto", "synthetic"):
      raise cli.UserError(f"--task={self.task.task}: activation_patching builds its pairs from the synthetic task "
                          "(--task=synthetic or auto)")
    if self.decode.temperature != 0:
      raise cli.UserError(f"--temperature={self.decode.temperature}: activation_patching compares runs decoded at "
                          "temperature 0")
    if self.decode.cfg_scale != 0:
      raise cli.UserError("--cfg_scale: activation_patching runs without guidance")

  def check_model(self, model: checkpoint_bundle.Model) -> dict:
    """The model's decoding values (one block of the whole generation for LLaDA / MMaDA unless
    --block_length is given, so every step computes the answer position's logits); refuses a sampler
    other than llada, mmada, dream, ar, a prompt format other than the training layout, and patch steps
    the run does not have."""
    if model.sampler not in SAMPLERS:
      raise cli.UserError(f"{model.label}: activation_patching supports the {', '.join(SAMPLERS)} samplers; "
                          f"{model.label} decodes with {model.sampler}")
    if model.prompt_format != "training":
      raise cli.UserError(f"{model.label}: activation_patching reads the answer at its position in the training "
                          "layout; use a model trained here (--prompt_format=training)")
    decode = self.decode
    if decode.block_length is None and model.decoder.blocks == "divide":
      length = decode_settings.model_settings(decode, model)["gen_length"]
      decode = dataclasses.replace(decode, block_length=length)
    values = decode_settings.model_settings(decode, model)
    n_steps = values["steps"] if model.diffusion else values["gen_length"]
    if self.patch_steps is not None and max(self.patch_steps) >= n_steps:
      raise cli.UserError(f"--patch_steps={','.join(map(str, self.patch_steps))}: {model.label} decodes in "
                          f"{n_steps} steps (0 to {n_steps - 1})")
    if self.head_window > n_steps:
      raise cli.UserError(f"--head_window={self.head_window}: {model.label} decodes in {n_steps} steps")
    return values


def run_model(runners: dict[str, PatchRunner], settings: Settings, model: checkpoint_bundle.Model,
              runtime: devices.Runtime, log: run_dir.ResultsLog) -> dict:
  """Patches every pair of the model not done yet with its runner (built before any weights were read), now on
  the model's loaded weights; returns its metadata for the report."""
  del settings, runtime  # the runner holds both
  runner = runners[model.label]
  runner.model = model
  runner.run(log)
  return runner.meta()


def main(argv):
  del argv
  shared = analysis_flags.from_flags("activation_patching", _CHECKPOINTS)
  models = shared.prepare_models()
  runtime = devices.init_runtime(shared.runtime)  # before anything touches a JAX backend (the numerics)
  steps = None if [s.strip() for s in _PATCH_STEPS.value] == ["all"] else cli.int_list(_PATCH_STEPS.value,
                                                                                        "patch_steps")
  settings = Settings(checkpoints=shared.checkpoints, n_pairs=_N_PAIRS.value, pairs_per_call=_PAIRS_PER_CALL.value,
                      sites=tuple(s.strip() for s in _SITES.value), patch_steps=steps, head_window=_HEAD_WINDOW.value,
                      attribution=_ATTRIBUTION.value, task=shared.task, decode=shared.decode,
                      numerics=numerics_flags.from_flags(shared.runtime))
  runners = {}
  for model in models:
    values = settings.check_model(model)
    pair_set = patching_pairs.build(model, settings.n_pairs, shared.task.data_seed, shared.decode.seed)
    if not pair_set.pairs:
      raise cli.UserError(f"{model.label}: no usable pair among the first {settings.n_pairs} problems "
                          f"(skipped: {pair_set.skipped})")
    runner = PatchRunner(settings, model, values, pair_set, runtime)
    for plan, thunk in runner.capture_plans():
      capture_budget.check(thunk, f"{model.label} {plan}", "lower --pairs_per_call or --n_pairs, patch fewer "
                           "--sites, or set --head_window")
    runners[model.label] = runner
  runs = model_runs.run_models(shared.output, settings, models, runtime, "synthetic",
                               functools.partial(run_model, runners))
  if runs is not None:
    progress.summary_banner(runs.out.path, patching_report.write(runs.out.path, runs.metas, runs.log.records,
                                                                 runs.seconds))


if __name__ == "__main__":
  cli.run(main)
