"""The sampler registry: one table from each sampler's name to its options class, how its options are built
from the settings every sampler shares, its public generate function and the facts callers ask about it.
The binaries (`experiments/`), the evaluation task code and the lm-eval adapter read samplers only here.

  name             model kind          default for            mask token  self-cond.  block queries  modes  likelihood
  llada            bidirectional       logit_shift 0          yes         no          no             all    yes
  mmada            bidirectional       (never the default)    yes         no          no             all    yes
  dream            bidirectional       logit_shift 1          yes         no          no             all    yes
  ar               causal              every causal model     no          no          no             none   yes
  block_diffusion  block_causal        every block-causal     yes         no          yes            τ      no
  diffusion_gemma  self_conditioning   every such model       no          yes         yes            none   no

"modes": the option fields the binaries' decoding modes set (`Sampler.mode_fields`; "all" = threshold,
factor, cache and their variants; "τ" = the threshold and the `transfer` rule it selects). "likelihood":
lm-eval's loglikelihood scores its models (the Monte-Carlo estimators for masked diffusion, teacher forcing
for the autoregressive). "block queries": a step's queries see no key after their own block or canvas
(block-causal attention; the DiffusionGemma decoder reads the prompt's cache), so a step's valid keys end
at its computed queries' stop.

What each decodes with by default and which settings of its own it has:

  name             official defaults  blocks     own variants                            own schedule  chat
  llada            128 / 128 / 128    divide     logits_eos_inf, confidence_eos_eot_inf  -             llada
  mmada            128 / 128 / 128    divide     stop_token_id                           -             mmada
  dream            512 / 512 / -      modes      -                                       -             dream
  ar               128 / - / -        none       -                                       -             llama3
  block_diffusion  2048 / 32 / model  attention  editing_threshold, max_post_steps       -             ling
  diffusion_gemma  256 / 48 / 256     canvas     -                                       (below)       -

"official defaults" (`Sampler.defaults`): gen_length / steps / block_length as the originals set them (LLaDA's
`generate` signature; Dream's generation config, whose README uses max_new_tokens = steps = 512; LLaDA2's
`generate`; HF's `DiffusionGemmaGenerationConfig`); "-": the sampler has no such setting, or its exact
decoding has no blocks; "model": the model's attention block. "blocks" (`Sampler.blocks`, `BlockRule`): how
gen_length, steps and block_length fit together. "own variants" (`Sampler.variant_fields`): option fields
beyond the common settings and the modes that switch on a variant of the original (off by default). "own
schedule" (`Sampler.schedule_fields`): option fields beyond the common settings that define its decoding
schedule, recorded with every run (DiffusionGemma's entropy_bound, t_min, t_max, confidence_threshold and
stability_threshold). "chat" (`Sampler.chat_template`): the chat template of the models it was written for
(`dlm_jax.io.tokenizer.chat_text`), for checkpoints that record none. DiffusionGemma also runs its own
temperature schedule (`Sampler.temperature_schedule`: t_max → t_min), so the common temperature does not apply
to it. LLaDA's and MMaDA's options choose how a left-padded batch's pads are treated
(`Sampler.official_padding`: what their originals do; LLaDA's Oct-2025 HF code hides pad keys, MMaDA applies
its outer-product mask and none under CFG); the other samplers have one way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Literal

from dlm_jax.config import ModelConfig
from dlm_jax.sampling import autoregressive, block_diffusion, diffusion_gemma, dream, llada
from dlm_jax.sampling.trace import Trace

ModelKind = Literal["bidirectional", "block_causal", "causal", "self_conditioning"]

BlockRule = Literal["divide", "modes", "attention", "canvas", "none"]
"""How a sampler's gen_length, steps and block_length fit together. divide: block_length divides
gen_length and steps (model calls in all) are a multiple of the number of blocks (LLaDA, MMaDA); modes: the
same, but exact decoding has no blocks and block_length applies under the decoding modes only (Dream);
attention: the blocks are the model's `attention_block_size`, steps count per block and the canvas runs on to
the last block's end (block diffusion); canvas: block_length is the canvas length and steps the most model
calls per canvas, both checked by its options (DiffusionGemma); none: neither steps nor blocks
(autoregressive)."""


def model_kind(config: ModelConfig) -> ModelKind:
  """The attention a model decodes with, which decides the samplers that fit it: self_conditioning
  (DiffusionGemma-style: causal encoder, self-conditioning decoder), causal, block_causal (LLaDA2.x) or
  bidirectional."""
  if config.self_conditioning:
    return "self_conditioning"
  if config.causal:
    return "causal"
  if config.attention_block_size is not None:
    return "block_causal"
  return "bidirectional"


@dataclasses.dataclass(frozen=True)
class CommonSettings:
  """The decoding settings samplers share; each sampler reads those in its `Sampler.common_fields` (under
  its own field names). gen_length, steps and block_length are the caller's to give; the other defaults equal
  every options class's own, so such a setting left at its default changes nothing.

  gen_length: generated positions; steps: model calls (LLaDA, Dream: in all; block diffusion: per block;
  DiffusionGemma: at most, per canvas); block_length: LLaDA's and Dream's blocks, block diffusion's block,
  DiffusionGemma's canvas; temperature, top_p, top_k: token sampling; cfg_scale, remasking: LLaDA's
  guidance and remasking; alg, alg_temp, eps: Dream's.
  """

  gen_length: int
  steps: int | None = None
  block_length: int | None = None
  temperature: float = 0.0
  top_p: float | None = None
  top_k: int | None = None
  cfg_scale: float = 0.0
  remasking: str = "low_confidence"
  alg: str = "origin"
  alg_temp: float | None = None
  eps: float = 1e-3


@dataclasses.dataclass(frozen=True)
class Defaults:
  """A sampler's official gen_length, steps and block_length (module docstring; None: it has no such
  setting, its exact decoding has no blocks, or the model decides)."""

  gen_length: int
  steps: int | None = None
  block_length: int | None = None


@dataclasses.dataclass(frozen=True)
class Sampler:
  """One sampler (module docstring).

  options_class: its options dataclass; make_options: builds one (the class, or a preset such as MMaDA's);
  generate: its public function `generate(params, prompt, *, config, options, key, prompt_mask, setup)`
  returning a `Trace`; common_fields: `CommonSettings` field -> options field; kind: the model kind it
  decodes; default_shift: it is the default sampler of its kind for models with this `logit_shift` (None:
  for every model of its kind; `default` False: never the default); needs_mask_token: decodes from mask
  tokens; self_conditioning: feeds its previous prediction back (uniform-state decoding); block_queries:
  a step's queries see no key after their block or canvas; mode_fields: the option fields decoding modes
  may set (empty: the modes do not apply); likelihood: its models' loglikelihood can be scored; defaults:
  the official lengths; blocks: how lengths fit together (`BlockRule`); variant_fields, schedule_fields:
  its own option fields beyond the common settings and mode fields (a variant's switches, off by default;
  its decoding schedule); official_padding: the options fields its original's left-padding handling sets
  (empty: the sampler has one policy); temperature_schedule: its options' first and last steps'
  temperature fields when it runs its own schedule instead of the common temperature; chat_template: the
  template of its models (module docstring); logit_shift: the `ModelConfig.logit_shift` it decodes (None: any;
  Dream reads shifted logits, block diffusion each position's own).
  """

  name: str
  options_class: type
  make_options: Callable[..., Any]
  generate: Callable[..., Trace]
  common_fields: Mapping[str, str]
  kind: ModelKind
  default: bool
  default_shift: int | None
  needs_mask_token: bool
  self_conditioning: bool
  block_queries: bool
  mode_fields: frozenset[str]
  likelihood: bool
  defaults: Defaults
  blocks: BlockRule
  variant_fields: tuple[str, ...] = ()
  schedule_fields: tuple[str, ...] = ()
  official_padding: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  temperature_schedule: tuple[str, str] | None = None
  chat_template: str | None = None
  logit_shift: int | None = None

  def options(self, common: CommonSettings, **specific: Any) -> Any:
    """The sampler's options: the common settings it reads, then its own fields (`specific`, which win over
    a common setting of the same field)."""
    values = {field: getattr(common, name) for name, field in self.common_fields.items()}
    values.update(specific)
    return self.make_options(**values)

  def fits(self, config: ModelConfig) -> bool:
    """The model's attention is the kind this sampler decodes, and its logit shift the one it reads."""
    return model_kind(config) == self.kind and self.logit_shift in (None, config.logit_shift)

  @property
  def has_modes(self) -> bool:
    """The decoding modes (threshold, factor, caches) apply."""
    return bool(self.mode_fields)

  @property
  def fields(self) -> frozenset[str]:
    """Its options' field names."""
    return frozenset(field.name for field in dataclasses.fields(self.options_class))


_LLADA_COMMON = {name: name for name in ("gen_length", "steps", "block_length", "temperature", "cfg_scale",
                                         "remasking")}
_LLADA_MODES = frozenset({"threshold", "factor", "factor_rule", "cache", "dual_cache_forwards", "rule", "window",
                          "eos_truncation"})
_LLADA_DEFAULTS = Defaults(gen_length=128, steps=128, block_length=128)
_DIFFUSION = dict(kind="bidirectional", needs_mask_token=True, self_conditioning=False, block_queries=False,
                  likelihood=True)

SAMPLERS: dict[str, Sampler] = {s.name: s for s in (
    Sampler("llada", llada.LLaDAOptions, llada.LLaDAOptions, llada.generate, _LLADA_COMMON, default=True,
            default_shift=0, mode_fields=_LLADA_MODES, defaults=_LLADA_DEFAULTS, blocks="divide",
            variant_fields=("logits_eos_inf", "confidence_eos_eot_inf"), official_padding={"padding": "key"},
            chat_template="llada", **_DIFFUSION),
    Sampler("mmada", llada.LLaDAOptions, llada.mmada_options, llada.generate, _LLADA_COMMON, default=False,
            default_shift=None, mode_fields=_LLADA_MODES, defaults=_LLADA_DEFAULTS, blocks="divide",
            variant_fields=("stop_token_id",), official_padding={"padding": "outer", "cfg_padding": False},
            chat_template="mmada", **_DIFFUSION),
    Sampler("dream", dream.DreamOptions, dream.DreamOptions, dream.diffusion_generate,
            {name: name for name in ("gen_length", "steps", "block_length", "temperature", "alg", "alg_temp",
                                     "top_p", "top_k", "eps")},
            default=True, default_shift=1,
            mode_fields=frozenset({"threshold", "factor", "factor_rule", "cache", "rule", "window", "eos_truncation"}),
            defaults=Defaults(gen_length=512, steps=512), blocks="modes", chat_template="dream", logit_shift=1,
            **_DIFFUSION),
    Sampler("ar", autoregressive.AROptions, autoregressive.AROptions, autoregressive.generate,
            {name: name for name in ("gen_length", "temperature", "top_p", "top_k")}, kind="causal", default=True,
            default_shift=None, needs_mask_token=False, self_conditioning=False, block_queries=False,
            mode_fields=frozenset(), likelihood=True, defaults=Defaults(gen_length=128), blocks="none",
            chat_template="llama3"),
    Sampler("block_diffusion", block_diffusion.BlockDiffusionOptions, block_diffusion.BlockDiffusionOptions,
            block_diffusion.generate,
            {name: name for name in ("gen_length", "steps", "block_length", "temperature", "top_p", "top_k")},
            kind="block_causal", default=True, default_shift=None, needs_mask_token=True, self_conditioning=False,
            block_queries=True, mode_fields=frozenset({"transfer", "threshold"}), likelihood=False,
            defaults=Defaults(gen_length=2048, steps=32), blocks="attention",
            variant_fields=("editing_threshold", "max_post_steps"), chat_template="ling", logit_shift=0),
    Sampler("diffusion_gemma", diffusion_gemma.DiffusionGemmaOptions, diffusion_gemma.DiffusionGemmaOptions,
            diffusion_gemma.generate,
            {"gen_length": "gen_length", "block_length": "canvas_length", "steps": "max_denoising_steps"},
            kind="self_conditioning", default=True, default_shift=None, needs_mask_token=False,
            self_conditioning=True, block_queries=True, mode_fields=frozenset(), likelihood=False,
            defaults=Defaults(gen_length=256, steps=48, block_length=256), blocks="canvas",
            schedule_fields=("entropy_bound", "t_min", "t_max", "confidence_threshold", "stability_threshold"),
            temperature_schedule=("t_max", "t_min")),
)}
"""Every sampler by name (module docstring)."""

NAMES: tuple[str, ...] = tuple(SAMPLERS)


def get(name: str) -> Sampler:
  """The named sampler; the error lists the known names."""
  if name not in SAMPLERS:
    raise ValueError(f"Unknown sampler {name!r}; expected one of {', '.join(NAMES)}.")
  return SAMPLERS[name]


def default_for(config: ModelConfig) -> Sampler:
  """The sampler a model decodes with by default: its kind's default, for bidirectional models the one of its
  logit shift (Dream's for shifted models, LLaDA's otherwise)."""
  kind = model_kind(config)
  return next(s for s in SAMPLERS.values()
              if s.default and s.kind == kind and s.default_shift in (None, config.logit_shift))
