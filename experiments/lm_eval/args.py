"""The `dlm_jax` model's model_args: parsed, checked (one line naming the argument on a bad value) and
resolved per task with a preset (`experiments.lm_eval.presets`).

  checkpoint      converted directory or tiny-dlm | tiny-arm | tiny-moe-dlm | tiny-uniform-dlm | smollm2 (required)
  sampler         auto | llada | mmada | dream | ar | block_diffusion | diffusion_gemma (auto: by the model)
  decoding        exact | threshold | factor | prefix_cache | dual_cache | threshold_prefix_cache |
                  threshold_dual_cache, with threshold / factor (`dlm_jax.session.decoding_mode`), or a
                  decoding rule eb | klass | wino | pc | certainty_prior with its knobs eb_gamma,
                  klass_conf_threshold, klass_kl_threshold, klass_kl_history_length, klass_variant
                  (llada_klass | dream_klass; unset: the model's own, dream_klass on Dream), wino_wide_in,
                  wino_narrow_out, pc_prior (a prior file), pc_lambda, pc_alpha, pc_variant, certainty_sigma
  cache           none | prefix | dual: a decoding rule's KV cache (eb, klass, pc, certainty_prior)
  window, eos_truncation
                  Elastic-Cache's decoding with threshold / factor and no cache (LLaDA, MMaDA, Dream without
                  blocks): a call's candidates are the block's first `window` masks; after the first EOS decoded
                  the masks after it stay masks
  policy          a compute policy while generating (`dlm_jax.policy`): none | d2cache | dkv_cache | dllm_cache |
                  elastic_cache | sparse_dllm | sparsed, knobs after a colon and "+" between them (lm-eval splits on
                  commas): sparse_dllm:keep_ratio=0.25+kernel_size=3; the decodings each takes:
                  docs/guides/compute_policies.md
  gen_length, steps, block_length, temperature, remasking, alg, alg_temp, top_p, top_k
                  generation (`dlm_jax.session.decode_settings`; unset = its per-model defaults, gen_length
                  then the request's max_gen_toks)
  cfg             guidance weight for generation and likelihood (0 = none)
  mask_sinks      K >= 0: mask the previous step's top-K sinks while generating (0 = off)
  sink_token      auto | none: the checkpoint's extra sink token (auto: as trained) or none
  steer           a steering file (JSON; `dlm_jax.session.steering_file`): activation additions at named sites
                  while generating (empty = none)
  prompt_format   auto | plain (BOS + text) | training (a diffusion model trained here: [PAD … BOS text] padded
                  with visible pads to its training prompt width, as `experiments.common.prompts`' training
                  layout). auto: the checkpoint's default, the rule of every entry point
                  (`dlm_jax.io.prompt_layout`): training when it records a training prompt width, else plain
                  (a checkpoint whose default is chat: lm-eval's --apply_chat_template applies its template)
  estimator       auto | llada | dream: the DLM likelihood estimator (auto: dream for shifted models)
  mc_num, mc_batch, eps, is_check_greedy
                  Monte-Carlo draws per request, draws per stratum, Dream's ε, greedy check of a DLM
  pairs_per_call  (request, draw) pairs per compiled likelihood call
  batch_size      prompts per sampler call and rows per teacher-forced call
  max_length      tokens kept of a context (left-truncated)
  dtype           float32 | bfloat16 | float16;  mesh  e.g. data:2+fsdp:2 ("+" for lm-eval's commas)
  seed            PRNG seed (per request keys derive from it and the request)
  preset          none | a name of `presets.PRESETS`

lm-eval also passes batch_size / max_batch_size / device from its own flags; batch_size "auto" and
max_batch_size / device are accepted and ignored (device: JAX's backend decides).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from dlm_jax.policy.registry import parse_policy
from dlm_jax.sampling import decoding_rules
from dlm_jax.session import SessionError, decode_settings, decoding_mode, steering_file
from dlm_jax.session.checkpoint_bundle import SAMPLERS
from experiments.common import numerics
from experiments.common.cli import UserError
from experiments.lm_eval import presets

ESTIMATORS = ("auto", "llada", "dream")
SINK_TOKENS = ("auto", "none")
PROMPT_FORMATS = ("auto", "plain", "training")


@dataclasses.dataclass(frozen=True)
class EvalArgs:
  """Every model arg (module docstring); `given`: the names the user set (they win over a preset)."""

  checkpoint: str
  sampler: str = "auto"
  decoding: str = "exact"
  threshold: float = decoding_mode.DEFAULT_THRESHOLD
  factor: float = decoding_mode.DEFAULT_FACTOR
  eb_gamma: float = decoding_rules.EBSampler.gamma
  klass_conf_threshold: float = decoding_rules.KLASS.conf_threshold
  klass_kl_threshold: float = decoding_rules.KLASS.kl_threshold
  klass_kl_history_length: int = decoding_rules.KLASS.kl_history_length
  klass_variant: str | None = None
  wino_wide_in: float = decoding_rules.WINO.wide_in
  wino_narrow_out: float = decoding_rules.WINO.narrow_out
  pc_prior: str | None = None
  pc_lambda: float = decoding_rules.PCSampler.lam
  pc_alpha: float = decoding_rules.PCSampler.alpha
  pc_variant: str = "pc_sampler"
  certainty_sigma: float = decoding_rules.CertaintyPrior.sigma
  cache: str = "none"
  window: int | None = None
  eos_truncation: bool = False
  policy: str = "none"
  gen_length: int | None = None
  steps: int | None = None
  block_length: int | None = None
  temperature: float = 0.0
  remasking: str = "low_confidence"
  alg: str = "entropy"
  alg_temp: float | None = None
  top_p: float | None = None
  top_k: int | None = None
  cfg: float = 0.0
  mask_sinks: int = 0
  sink_token: str = "auto"
  steer: str = ""
  prompt_format: str = "auto"
  estimator: str = "auto"
  mc_num: int = 128
  mc_batch: int = 32
  eps: float = 1e-3
  is_check_greedy: bool = False
  pairs_per_call: int = 64
  batch_size: int = 8
  max_length: int = 4096
  dtype: str = "float32"
  mesh: str = ""
  seed: int = 0
  preset: str | None = None
  given: frozenset = frozenset()

  def __post_init__(self):
    _choice("sampler", self.sampler, SAMPLERS)
    _choice("decoding", self.decoding, tuple(decoding_mode.ALL_MODES))
    _choice("remasking", self.remasking, decode_settings.REMASKING)
    _choice("alg", self.alg, decode_settings.DREAM_ALGS)
    _choice("sink_token", self.sink_token, SINK_TOKENS)
    _choice("prompt_format", self.prompt_format, PROMPT_FORMATS)
    _choice("estimator", self.estimator, ESTIMATORS)
    _choice("dtype", self.dtype, numerics.DTYPES)
    if self.preset is not None:
      _choice("preset", self.preset, tuple(presets.PRESETS))
    for name in ("gen_length", "steps", "block_length", "top_k"):
      if getattr(self, name) is not None and getattr(self, name) < 1:
        raise UserError(f"model_args {name}={getattr(self, name)}: expected a positive integer")
    for name in ("mc_num", "mc_batch", "pairs_per_call", "batch_size", "max_length"):
      if getattr(self, name) < 1:
        raise UserError(f"model_args {name}={getattr(self, name)}: expected a positive integer")
    for name in ("temperature", "cfg", "mask_sinks"):
      if getattr(self, name) < 0:
        raise UserError(f"model_args {name}={getattr(self, name)}: expected >= 0")
    if self.top_p is not None and not 0 < self.top_p <= 1:
      raise UserError(f"model_args top_p={self.top_p}: expected a value in (0, 1]")
    if not 0 < self.eps < 1:
      raise UserError(f"model_args eps={self.eps}: expected a value in (0, 1)")
    try:
      parse_policy(str(self.policy).replace("+", ","))
    except ValueError as e:
      raise UserError(f"model_args policy={self.policy}: {e}") from None
    try:
      self.mode  # pylint: disable=pointless-statement
    except ValueError as e:
      raise UserError(f"model_args decoding={self.decoding}: {e}") from None
    if self.steer:
      try:
        steering_file.read(self.steer)
      except SessionError as e:
        raise UserError(f"model_args steer={self.steer}: {e}") from None

  @property
  def mode(self) -> decoding_mode.DecodingMode:
    knobs = decoding_mode.rule_knobs(self.decoding, {name: getattr(self, name) for name in decoding_mode.RULE_ARGS})
    return decoding_mode.from_values(self.decoding, self.threshold, self.factor, knobs=knobs,
                                     policy=str(self.policy).replace("+", ","), cache=self.cache, window=self.window,
                                     eos_truncation=self.eos_truncation)

  @property
  def runtime_mesh(self) -> str:
    """--mesh text of `experiments.common.devices` ("+" separated here, "," there)."""
    return self.mesh.replace("+", ",")

  def for_task(self, task: str | None) -> EvalArgs:
    """These args with the preset's values for `task` where the user gave none."""
    values = {k: v for k, v in presets.task_values(self.preset, task).items() if k not in self.given}
    if "mc_num" in values and "mc_batch" not in self.given:
      values["mc_batch"] = min(values.get("mc_batch", self.mc_batch), values["mc_num"])
    return dataclasses.replace(self, **values) if values else self


def _choice(name: str, value: Any, choices) -> None:
  if value not in choices:
    raise UserError(f"model_args {name}={value}: expected one of {', '.join(map(str, choices))}")


_TYPES = {f.name: f.type for f in dataclasses.fields(EvalArgs)}


def _convert(name: str, value: Any) -> Any:
  kind = _TYPES[name]
  if value is None or (isinstance(value, str) and value.lower() == "none" and "None" in kind):
    return None
  try:
    if kind.startswith("int"):
      if isinstance(value, bool) or float(value) != int(float(value)):
        raise ValueError
      return int(float(value))
    if kind.startswith("float"):
      if isinstance(value, bool) or not math.isfinite(float(value)):
        raise ValueError
      return float(value)
    if kind == "bool":
      if isinstance(value, bool):
        return value
      if str(value).lower() in ("true", "1", "false", "0"):
        return str(value).lower() in ("true", "1")
      raise ValueError
  except (TypeError, ValueError):
    raise UserError(f"model_args {name}={value}: expected {kind.replace(' | None', ' or none')}") from None
  return str(value)


def parse(kwargs: dict[str, Any]) -> EvalArgs:
  """EvalArgs from lm-eval's keyword arguments (model_args and its additional config)."""
  kwargs = dict(kwargs)
  kwargs.pop("max_batch_size", None)
  kwargs.pop("device", None)
  if kwargs.get("batch_size") in (None, "auto") or str(kwargs.get("batch_size")).startswith("auto"):
    kwargs.pop("batch_size", None)
  unknown = sorted(set(kwargs) - set(_TYPES) - {"given"}) + (["given"] if "given" in kwargs else [])
  if unknown:
    raise UserError(f"model_args {unknown[0]}: unknown argument; expected one of "
                    f"{', '.join(n for n in _TYPES if n != 'given')}")
  if not kwargs.get("checkpoint"):
    raise UserError("model_args checkpoint: required (a converted directory or an embedded model name)")
  if "preset" in kwargs and str(kwargs["preset"]).lower() == "none":
    kwargs["preset"] = None
  values = {name: _convert(name, value) for name, value in kwargs.items()}
  return EvalArgs(**values, given=frozenset(values))
