"""What to capture and what to edit at the named sites (`dlm_jax.instrument.sites`): the static half.

A `Hooks` is a frozen (hashable) description — sites × layers × steps × positions × reduction for each
`Capture`, sites × layers × position class × operation for each `Edit` — and is part of a compiled
program's key. Everything that varies between conditions (directions, steering vectors, coefficients,
step windows, per-row layer / head / position choices, patch values) is traced state
(`dlm_jax.instrument.hook_call`), so one compiled program serves every coefficient, window and patch
source. A site no `Capture` or `Edit` names adds nothing to the program.

Position classes (of the queries of a call; a sampler sets them at each call, a plain forward call
counts every position as "all" unless told otherwise):
  all        every real (non-padding) query position;
  prompt     prompt positions;
  masked     generated positions still unresolved (holding the mask token; DiffusionGemma: not yet
             accepted, `dlm_jax.instrument.stats.QUERY_GROUP_NAMES`);
  decoded    generated positions already resolved;
  committed  decoded positions that were unresolved at the previous call (just committed).

Reductions of a capture, over the site's last (feature) axis unless said:
  none       the values themselves;
  mean       the mean over the positions of the class in the call: [B, F...] (no position axis);
  norm       the L2 norm: [.., F[:-1]...];
  topk       the k largest values and their indices (`TopK`): [.., F[:-1]..., k];
  project    the dot products with R given directions [R, F_last] (traced): [.., F[:-1]..., R];
  lens       the logit lens (residual sites): the final norm and LM head applied to the value, read at
             given target tokens: `LensReadout` (probability and rank of the target, top-k tokens);
  sae        a sparse autoencoder's feature activations (the SAE is traced: `CaptureValues.sae`; the site's
             features flattened): [.., d_sae], or with k >= 1 their k largest (`TopK`)
             (`dlm_jax.instrument.sae_hooks`, which also holds the SAE edits "sae_splice" / "sae_features").
"""

from __future__ import annotations

import dataclasses

from dlm_jax.config import ModelConfig
from dlm_jax.instrument import sites
from dlm_jax.instrument.step_schedule import StepSchedule, check as check_schedule

POSITION_CLASSES = ("all", "prompt", "masked", "decoded", "committed")
REDUCTIONS = ("none", "mean", "norm", "topk", "project", "lens", "sae")
EDIT_OPS = ("zero", "mean", "replace", "add", "scale", "sae_splice", "sae_features")
STEP_KINDS = ("all", "at", "every", "block_starts", "decoded")
RESIDUAL_SITES = ("hook_embed", "hook_resid_pre", "hook_resid_mid", "hook_resid_post", "hook_attn_out",
                  "hook_mlp_out", "ln_final.hook_normalized")


@dataclasses.dataclass(frozen=True)
class Steps:
  """Which sampler steps (model calls, numbered as `Trace.nfe` counts them) a capture keeps.

  kind: "all"; "at" (the steps in `at`); "every" (0, k, 2k, …); "block_starts" (the first call of each
  block: the first step of each phase of a KV-cache mode, of each semi-autoregressive block, of each
  canvas); "decoded" (for each position, the step at which it was decoded: one value per position, no
  step axis). Build with `Steps.every_step()`, `Steps.at_steps(0, 5)`, `Steps.every(4)`,
  `Steps.block_starts()`, `Steps.decoded()`.
  """

  kind: str = "all"
  at: tuple[int, ...] = ()
  every_k: int = 0

  def __post_init__(self):
    if self.kind not in STEP_KINDS:
      raise ValueError(f"Steps.kind must be one of {', '.join(STEP_KINDS)}, got {self.kind!r}.")
    if self.kind == "at":
      if not self.at or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in self.at):
        raise ValueError(f"Steps.at_steps needs at least one step index >= 0, got {self.at!r}.")
      if len(set(self.at)) != len(self.at):
        raise ValueError(f"Steps.at_steps has repeated steps: {self.at!r}.")
    if self.kind == "every" and (isinstance(self.every_k, bool) or not isinstance(self.every_k, int)
                                 or self.every_k <= 0):
      raise ValueError(f"Steps.every needs a positive integer k, got {self.every_k!r}.")

  @classmethod
  def every_step(cls) -> Steps:
    return cls("all")

  @classmethod
  def at_steps(cls, *steps: int) -> Steps:
    return cls("at", at=tuple(steps))

  @classmethod
  def every(cls, k: int) -> Steps:
    return cls("every", every_k=k)

  @classmethod
  def block_starts(cls) -> Steps:
    return cls("block_starts")

  @classmethod
  def decoded(cls) -> Steps:
    return cls("decoded")

  def slots(self, max_steps: int) -> tuple[int, ...]:
    """For "all" / "at" / "every": the slot of each step 0..max_steps−1 in the capture's step axis (−1 when
    the step is not kept); steps of `at` beyond the run's bound keep no slot."""
    if self.kind == "all":
      return tuple(range(max_steps))
    kept = [s for s in range(max_steps) if (s in self.at if self.kind == "at" else s % self.every_k == 0)]
    return tuple(kept.index(s) if s in kept else -1 for s in range(max_steps))


def _layers(layers, what: str) -> tuple[int, ...] | None:
  if layers is None:
    return None
  if isinstance(layers, int) and not isinstance(layers, bool):
    layers = (layers,)
  layers = tuple(layers)
  if not layers or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers):
    raise ValueError(f"{what}.layers must be None (every layer) or layer indices >= 0, got {layers!r}.")
  if len(set(layers)) != len(layers):
    raise ValueError(f"{what}.layers has repeated layers: {layers!r}.")
  return layers


def _site(site: str, layers, what: str) -> tuple[str, tuple[int, ...] | None]:
  """The site kind and layers of `site` ("blocks.3.hook_z" names its layer; "hook_z" takes `layers`)."""
  kind, layer = sites.parse(site)
  layers = _layers(layers, what)
  if layer is not None:
    if layers is not None and layers != (layer,):
      raise ValueError(f"{what} names layer {layer} in its site {site!r} and layers={layers!r}; give one.")
    layers = (layer,)
  if kind in sites.MODEL_SITES and layers is not None:
    raise ValueError(f"{what}: {kind} is a model-level site and takes no layers.")
  return kind, layers


@dataclasses.dataclass(frozen=True)
class Capture:
  """One capture: a site over layers, steps and positions, reduced (module docstring).

  site: a site kind ("hook_resid_pre", "attn.hook_z", "hook_embed", …) with `layers`, or a full name
    ("blocks.3.hook_resid_pre").
  layers: the layers of a per-layer site (None: every layer where the site exists).
  steps: `Steps` (sampler runs only; a plain forward call is one step).
  positions: a position class, or a tuple of sequence indices (the values at those positions only: the
    position axis becomes P = len(positions)); "attn.hook_pattern" needs the query indices as a tuple.
  reduce: one of `REDUCTIONS`; k: the k of "topk" and the top tokens of "lens"; of "sae": 0 keeps every
    feature, k >= 1 the k largest.
  label: a name for the captured arrays instead of the site name (to capture one site twice).
  """

  site: str
  layers: tuple[int, ...] | int | None = None
  steps: Steps = Steps()
  positions: str | tuple[int, ...] = "all"
  reduce: str = "none"
  k: int = 0
  label: str | None = None

  def __post_init__(self):
    kind, layers = _site(self.site, self.layers, "Capture")
    object.__setattr__(self, "site", kind)
    object.__setattr__(self, "layers", layers)
    if not isinstance(self.steps, Steps):
      raise ValueError(f"Capture.steps must be a Steps (e.g. Steps.every(4)), got {self.steps!r}.")
    if isinstance(self.positions, list):
      object.__setattr__(self, "positions", tuple(self.positions))
    if isinstance(self.positions, tuple):
      if not self.positions or not all(isinstance(p, int) and not isinstance(p, bool) and p >= 0
                                       for p in self.positions):
        raise ValueError(f"Capture.positions must be a position class or sequence indices >= 0, got "
                         f"{self.positions!r}.")
    elif self.positions not in POSITION_CLASSES:
      raise ValueError(f"Capture.positions must be one of {', '.join(POSITION_CLASSES)} or a tuple of sequence "
                       f"indices, got {self.positions!r}.")
    if self.reduce not in REDUCTIONS:
      raise ValueError(f"Capture.reduce must be one of {', '.join(REDUCTIONS)}, got {self.reduce!r}.")
    if self.reduce in ("topk", "lens") and (isinstance(self.k, bool) or not isinstance(self.k, int) or self.k <= 0):
      raise ValueError(f"Capture.reduce={self.reduce!r} needs k >= 1, got k={self.k!r}.")
    if self.reduce == "sae" and (isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 0):
      raise ValueError(f"Capture.reduce='sae' needs k >= 0 (0: every feature), got k={self.k!r}.")
    if self.reduce == "lens" and kind not in RESIDUAL_SITES:
      raise ValueError(f"Capture.reduce='lens' reads a residual-stream site ({', '.join(RESIDUAL_SITES)}), "
                       f"not {kind}.")
    if kind == "attn.hook_pattern":
      if not isinstance(self.positions, tuple) or self.reduce != "none":
        raise ValueError("Capture of attn.hook_pattern needs positions=(query indices, ...) and reduce='none': "
                         "it returns those queries' attention rows [B, P, N, S].")
    if self.reduce == "mean" and isinstance(self.positions, tuple):
      raise ValueError("Capture.reduce='mean' averages over a position class; give positions as a class.")
    if self.steps.kind == "decoded" and (self.reduce == "mean" or kind == "attn.hook_pattern"):
      raise ValueError("Capture with Steps.decoded() keeps one value per position; it needs a per-position "
                       "reduction (not 'mean', not attn.hook_pattern).")
    if self.label is not None and (not isinstance(self.label, str) or not self.label):
      raise ValueError(f"Capture.label must be a non-empty string or None, got {self.label!r}.")

  def names(self, layers: tuple[int | None, ...]) -> tuple[str, ...]:
    """The names of the captured arrays for these resolved layers: the site names, or label(.l)."""
    if self.label is None:
      return tuple(sites.full_name(self.site, layer) for layer in layers)
    return tuple(self.label if layer is None else f"{self.label}.{layer}" for layer in layers)


@dataclasses.dataclass(frozen=True)
class Edit:
  """One edit of a site's values (module docstring), applied where its traced state allows it.

  op: "zero" (zero-ablation), "mean" (mean-ablation: each edited value becomes the mean of the edited
    positions of its row in the call; a dataset mean is `replace` with a vector), "replace" (by the source:
    activation patching), "add" (value + coefficient · source: steering), "scale" (coefficient · value),
    "sae_splice" / "sae_features" (a sparse autoencoder's reconstruction, with feature clamps and additions;
    `dlm_jax.instrument.sae_hooks`).
  site, layers: as in `Capture` (None: every layer where the site exists).
  positions: the position class edited (the traced per-row position mask narrows it further).
  source: for "replace" / "add": "vector" (one [F...] value per row, broadcast over positions) or "values"
    (per-position values in sequence coordinates, per step and layer: patching from a captured run).
  schedule: a `dlm_jax.instrument.step_schedule.StepSchedule` ("add" with source "vector" only): the
    coefficient and direction per step, optionally gated by a capture read earlier in the same forward.
  """

  site: str
  op: str
  layers: tuple[int, ...] | int | None = None
  positions: str = "all"
  source: str = "vector"
  schedule: StepSchedule | None = None

  def __post_init__(self):
    kind, layers = _site(self.site, self.layers, "Edit")
    object.__setattr__(self, "site", kind)
    object.__setattr__(self, "layers", layers)
    if kind == "attn.hook_pattern":
      raise ValueError("attn.hook_pattern can be captured, not edited; change attention with an attention-bias "
                       "intervention (dlm_jax.instrument.interventions).")
    if self.op not in EDIT_OPS:
      raise ValueError(f"Edit.op must be one of {', '.join(EDIT_OPS)}, got {self.op!r}.")
    if self.positions not in POSITION_CLASSES:
      raise ValueError(f"Edit.positions must be one of {', '.join(POSITION_CLASSES)}, got {self.positions!r}; "
                       "choose explicit positions with the edit's traced position mask.")
    if self.source not in ("vector", "values"):
      raise ValueError(f"Edit.source must be 'vector' or 'values', got {self.source!r}.")
    if self.schedule is not None and (not isinstance(self.schedule, StepSchedule) or self.op != "add"
                                      or self.source != "vector"):
      raise ValueError("Edit.schedule must be a StepSchedule, on an 'add' edit with source 'vector'.")


@dataclasses.dataclass(frozen=True)
class Hooks:
  """The static half of an instrumented run: captures and edits (module docstring)."""

  captures: tuple[Capture, ...] = ()
  edits: tuple[Edit, ...] = ()

  def __post_init__(self):
    for field, cls in (("captures", Capture), ("edits", Edit)):
      value = getattr(self, field)
      if isinstance(value, (Capture, Edit)):
        value = (value,)
      value = tuple(value)
      if not all(isinstance(v, cls) for v in value):
        raise ValueError(f"Hooks.{field} must be {cls.__name__} objects, got {value!r}.")
      object.__setattr__(self, field, value)

  @property
  def enabled(self) -> bool:
    return bool(self.captures or self.edits)

  def kinds(self) -> frozenset[str]:
    """The site kinds some capture or edit names."""
    return frozenset(x.site for x in (*self.captures, *self.edits))

  def resolved_layers(self, config: ModelConfig, item: Capture | Edit) -> tuple[int | None, ...]:
    """The layers `item` acts at in this model ((None,) for a model-level site); raises ValueError naming the
    site when a named layer lacks it. None (every layer) keeps the layers where the site exists."""
    if item.site in sites.MODEL_SITES:
      return (None,)
    if item.layers is None:
      layers = tuple(l for l in range(config.n_layers) if sites.unavailable(config, item.site, l) is None)
      if not layers:
        raise ValueError(f"{item.site}: no layer of {config.name} has this site.")
      return layers
    for layer in item.layers:
      why = sites.unavailable(config, item.site, layer)
      if why is not None:
        raise ValueError(why)
    return item.layers

  def check(self, config: ModelConfig) -> None:
    """Raises ValueError (one line) for a site this model lacks, mixed per-head shapes in one capture, or
    two captures with the same array name."""
    seen: set[str] = set()
    for capture in self.captures:
      layers = self.resolved_layers(config, capture)
      for name in capture.names(layers):
        if name in seen:
          raise ValueError(f"two captures produce {name!r}; give one of them a distinct label.")
        seen.add(name)
    for edit in self.edits:
      layers = self.resolved_layers(config, edit)
      shapes = {sites.feature_shape(config, edit.site, layer) for layer in layers}
      if len(shapes) > 1:
        raise ValueError(f"Edit of {edit.site} spans layers of different head shapes {sorted(shapes)} "
                         "(sliding and global layers); use one Edit per layer kind.")
    gated = [(i, e) for i, e in enumerate(self.edits) if e.schedule is not None and e.schedule.gate is not None]
    if gated:
      names = {name: (capture, layer) for capture in self.captures
               for layer, name in zip(self.resolved_layers(config, capture),
                                      capture.names(self.resolved_layers(config, capture)))}
      for i, edit in gated:
        check_schedule(edit.schedule, self.resolved_layers(config, edit), names, f"Edit {i} ({edit.site})")

  def capture_names(self, config: ModelConfig) -> dict[str, int]:
    """{captured array name: index of its capture in `captures`}."""
    return {name: i for i, capture in enumerate(self.captures)
            for name in capture.names(self.resolved_layers(config, capture))}


NO_HOOKS = Hooks()
