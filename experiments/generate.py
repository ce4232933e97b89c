"""Generates from a converted checkpoint with one of the compiled samplers: prints the decoded text, the NFE
and the time, and optionally writes the trace as JSON (--json_out) and the per-step attention (--stats_out).

  python -m experiments.generate --checkpoint=CHECKPOINT (--prompt=TEXT | --prompt_ids=1,2,3)
      [--prompt_format=auto|training|chat|plain|raw] [--sampler=SAMPLER] [--json_out=FILE.json]
      [--stats_out=FILE.npz] [--gen_length=N --steps=N --block_length=N --temperature=T --seed=S ...]
      [--nostop_at_eos] [--mask_sinks=K] [--decoding=MODE --threshold=0.9 --factor=1.0]

  CHECKPOINT: a converted directory, or tiny-dlm, tiny-arm, tiny-moe-dlm, tiny-uniform-dlm, smollm2.
  SAMPLER: auto, llada, mmada, dream, ar, block_diffusion, diffusion_gemma.
  MODE: exact, threshold, factor, prefix_cache, dual_cache, threshold_prefix_cache, threshold_dual_cache, and the
  decoding rules eb, klass, wino, pc (--pc_prior=FILE), certainty_prior (knobs: --eb_gamma, --klass_*, --wino_*,
  --pc_*, --certainty_sigma).

  python -m experiments.generate --checkpoint=tiny-dlm \\
      --prompt="Anna has 16 books. She finds 4 more. She buys 2 more. How many books does Anna have?"

Prompt layout (--prompt_format; --chat is --prompt_format=chat): `training` puts --prompt in the layout the
checkpoint was trained with, read from its training.json (the embedded models: `[PAD … BOS question]` of
the training prompt width for a diffusion model, `[BOS question]` for an autoregressive one;
`experiments.common.prompts`), and its gen_length / steps / block_length default to the training answer width
(one block); `chat` wraps it as one user turn in the chat template; `plain` is BOS + text; `raw` the
tokenizer's ids alone. `auto` (default): chat with --chat, else the checkpoint's default, the same rule in every
entry point (`dlm_jax.io.prompt_layout`): training when it records a training prompt width, else chat when it
records a chat template, else plain. A prompt longer than the recorded training prompt width, or a prompt plus
--gen_length longer than the recorded training sequence, is refused (the model never saw one). An empty --prompt
(or one of whitespace only) is a usage error: no sampler starts from nothing (--prompt_ids can start from BOS).

End of the reply: generation stops at EOS (and EoT, and the chat template's end-of-turn token) for every
sampler — `ar` stops producing tokens there, the diffusion samplers' "text" ends there — unless
--nostop_at_eos (then `ar` runs gen_length tokens and "text" is every generated token, special ones
skipped).

Defaults outside the training layout are the official ones (`dlm_jax.sampling.registry`: `Sampler.defaults`): LLaDA
/ MMaDA gen_length = steps = block_length = 128 (LLaDA's `generate` signature); Dream gen_length = steps = 512 with
alg origin, eps 1e-3, temperature 0 and no top-p / top-k (Dream's generation config; its README uses max_new_tokens
= steps = 512); ar gen_length 128, greedy; block_diffusion (block-causal models: LLaDA2.x) gen_length 2048, steps
32 per block, blocks of the model's `attention_block_size`, τ 0.95, EOS stop, exact KV cache (LLaDA2's `generate`,
whose answer — the first gen_length tokens up to the first EOS — is "text"); --editing_threshold=0.9 adds
LLaDA2.1's token editing (--max_post_steps 16); diffusion_gemma (DiffusionGemma-style uniform-state models) HF's
`DiffusionGemmaGenerationConfig`: gen_length 256 in canvases of --block_length 256, at most --steps 48 decoder
steps per canvas, --entropy_bound 0.1, temperatures --t_max 0.8 → --t_min 0.4 (--temperature does not apply),
adaptive stopping at mean entropy < --confidence_threshold 0.005 (0 = off) with --stability_threshold 1, EOS stop.
The experiment binaries (sink_analysis, ...) use other defaults, said in their --helpfull. A sampler knob (`knobs`:
the registry's common settings a sampler reads and its own fields) given for a sampler that does not have it is
ignored with a warning.

--decoding (LLaDA / MMaDA; `dlm_jax.session.decoding_mode`): exact (default), Fast-dLLM's confidence-threshold
(--threshold, default 0.9) or factor (--factor, default 1.0) parallel decoding, the prefix or dual KV cache
(refreshed at every block start), or threshold decoding with a cache. Dream's modes decode in blocks of
--block_length (required there; Dream's exact decoding has no blocks), but for Elastic-Cache's decoding
(--window / --eos_truncation with --decoding=threshold or a factor mode, LLaDA, MMaDA and Dream), which Dream
runs without blocks, as the official Dream loop; for ar the flag is ignored with a warning.

--chat wraps --prompt as one user turn in the chat template recorded in the checkpoint (ChatML for
SmolLM2 and Qwen-family checkpoints; `experiments.common.chat`), else the sampler's (--template overrides).
Text the tokenizer maps to unknown tokens is warned about.

Standard output: the text (or, without a tokenizer, the generated ids), then one line with the generated
tokens, NFE, the wall time of the generation (compilation included) and the JSON path.
JSON (written atomically): tokens (the whole sequence, prompt included), prompt_length, decode_step (per
generated position, the 0-based step at which it was unmasked; for `ar` the step that produced it), nfe
(model calls), row_nfe (the calls the row decoded with; equal to nfe for one prompt), decoding (the mode,
e.g. "threshold:0.9"), sampler, prompt_format, wall_s (the generation's wall time), settings (every value
used), and text (the generated part up to the end of the reply, special tokens skipped) when the checkpoint
has a tokenizer.
NPZ (--stats_out): incoming_attention [nfe, L, N, S] float32 for batch row 0: entry [t, l, n, j] is the
sum over the queries step t computed of the attention key j receives in layer l, head n, during the model
call of step t (with CFG, the conditional call); computed_queries [nfe, 2] int32, those queries' positions
[start, stop): [0, S) for a whole-sequence step, [s, S) or the block [s, e) for the prefix / dual cache steps
after a block's refresh. The keys are all S positions, cached ones included. For a mixture-of-experts model
also routed_experts / routing_weights [nfe, L, S, k] (row 0's router choice per step, layer and position;
expert -1 / weight 0 in dense layers and at positions the step did not compute).
--mask_sinks=K > 0 masks, at every step, the top-K sinks of the previous step
(`dlm_jax.instrument.interventions.MaskPreviousSinks(top_k=K)`; `MaskPreviousSinksAR` for --sampler=ar).
Runtime flags (`experiments.common.devices`): --mesh (parameters sharded over fsdp/tensor; the one prompt
is replicated), --distributed, --cpu_devices, --matmul_precision; numerics: --dtype (default float32 on
CPU, stored dtype on accelerators), --attention_impl, --query_chunk.
"""

from __future__ import annotations

import dataclasses
import json
import time

import jax
import numpy as np
from absl import flags, logging

from dlm_jax.io import prompt_layout
from dlm_jax.runtime import distributed
from dlm_jax.sampling import registry
from dlm_jax.session import (CombinationError, SessionError, checkpoint_bundle, decode_settings, sampler_options,
                             size_limits, training_record)
from dlm_jax.session.decoding_mode import DecodingMode
from experiments.common import (atomic_files, chat, checkpoints, cli, decoding, decoding_flags, devices, flag_checks,
                                items, numerics, numerics_flags, prompts, run_dir, runtime_flags)
from experiments.common.numerics import Numerics
from dlm_jax.sampling.run_setup import RunSetup

_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "Converted checkpoint directory, or "
                                  f"{', '.join(checkpoints.NAMES)}.", required=True)
_PROMPT = flags.DEFINE_string("prompt", None, "Prompt text (needs the checkpoint's tokenizer).")
_CHAT = flags.DEFINE_bool("chat", False, "Wrap --prompt as one user turn in the checkpoint's chat template "
                          "(--prompt_format=chat).")
_PROMPT_FORMAT = flags.DEFINE_enum("prompt_format", "auto", ["auto", "training", "chat", "plain", "raw"],
                                   "Layout of --prompt (module docstring; auto: chat with --chat, else the "
                                   "checkpoint's default: training when it records a training prompt width, else "
                                   "chat when it records a chat template, else plain).")
_STOP_AT_EOS = flags.DEFINE_bool("stop_at_eos", True, "End the reply at the first EOS / EoT / end-of-turn token "
                                 "(ar stops there; text ends there for every sampler).")
_TEMPLATE = flags.DEFINE_enum("template", None, list(chat.TEMPLATES), "Chat template (default: the one recorded "
                              "in the checkpoint, else llada, mmada, dream or llama3 by --sampler).")
_PROMPT_IDS = flags.DEFINE_string("prompt_ids", None, "Comma-separated prompt token ids.")
_SAMPLER = flags.DEFINE_enum("sampler", "auto", list(checkpoint_bundle.SAMPLERS),
                             "Sampler (auto: diffusion_gemma for DiffusionGemma-style models, ar for other causal "
                             "models, block_diffusion for block-causal ones, dream for shifted DLMs, llada otherwise).")
_GEN_LENGTH = flags.DEFINE_integer("gen_length", None, "Generated positions (default 128; Dream 512, its "
                                   "max_new_tokens).")
_STEPS = flags.DEFINE_integer("steps", None, "Denoising steps (default: LLaDA/MMaDA 128, Dream 512).")
_BLOCK_LENGTH = flags.DEFINE_integer("block_length", None, "LLaDA/MMaDA block length (default 128, as LLaDA's "
                                     "generate; must divide gen_length); Dream's --decoding modes' blocks.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "Sampling temperature (0 = argmax).")
_REMASKING = flags.DEFINE_enum("remasking", "low_confidence", list(decode_settings.REMASKING), "LLaDA/MMaDA "
                               "remasking.")
_CFG_SCALE = flags.DEFINE_float("cfg_scale", 0.0, "LLaDA/MMaDA classifier-free guidance weight.")
_LOGITS_EOS_INF = flags.DEFINE_bool("logits_eos_inf", False, "LLaDA: EOS is never sampled.")
_CONF_EOS_EOT_INF = flags.DEFINE_bool("confidence_eos_eot_inf", False, "LLaDA: the official EOS/EoT confidence "
                                      "rule.")
_STOP_AT_EOT = flags.DEFINE_bool("stop_at_eot", False, "MMaDA mmu_generate_fast: stop when a block ends in EoT.")
_ALG = flags.DEFINE_enum("alg", "origin", list(decode_settings.DREAM_ALGS), "Dream alg "
                         "(default origin, Dream's generation config).")
_ALG_TEMP = flags.DEFINE_float("alg_temp", None, "Dream alg_temp (None/0 = deterministic positions).")
_TOP_P = flags.DEFINE_float("top_p", None, "Top-p filtering in (0, 1] (Dream, ar).")
_TOP_K = flags.DEFINE_integer("top_k", None, "Top-k filtering (Dream, ar).")
_EPS = flags.DEFINE_float("eps", 1e-3, "Dream's last timestep, in (0, 1).")
_SEED = flags.DEFINE_integer("seed", 0, "PRNG seed.")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Optional output JSON file (tokens, decode steps, NFE, text, "
                                "settings).")
_STATS_OUT = flags.DEFINE_string("stats_out", None, "Optional .npz with per-step incoming attention.")
_EDITING_THRESHOLD = flags.DEFINE_float("editing_threshold", None, "block_diffusion: LLaDA2.1's token editing "
                                        "threshold τ_edit in [0, 1] (LLaDA2.1's default 0.9; unset = LLaDA2.0).")
_MAX_POST_STEPS = flags.DEFINE_integer("max_post_steps", 16, "block_diffusion with --editing_threshold: calls on a "
                                       "mask-free block while it is still being edited.")
_MASK_SINKS = flags.DEFINE_integer("mask_sinks", 0, "Mask the previous step's top-K sinks (0 = off).")
_ENTROPY_BOUND = flags.DEFINE_float("entropy_bound", 0.1, "diffusion_gemma: the acceptance entropy bound (> 0).")
_T_MIN = flags.DEFINE_float("t_min", 0.4, "diffusion_gemma: temperature of a canvas's last decoder step (> 0).")
_T_MAX = flags.DEFINE_float("t_max", 0.8, "diffusion_gemma: temperature of a canvas's first decoder step (> 0).")
_CONFIDENCE_THRESHOLD = flags.DEFINE_float("confidence_threshold", 0.005, "diffusion_gemma: adaptive stopping's "
                                           "mean-entropy bound (0 = no adaptive stopping).")
_STABILITY_THRESHOLD = flags.DEFINE_integer("stability_threshold", 1, "diffusion_gemma: earlier steps whose argmax "
                                            "canvas must equal the current one to stop (>= 0).")

SHARED_FLAGS = ("gen_length", "temperature")
"""Common settings that are no sampler's own knob: every sampler has gen_length; --temperature is warned about
on its own where a sampler runs its own temperature schedule."""
FLAG_OF_FIELD = {"stop_token_id": "stop_at_eot"}
"""Own options fields set by a flag of another name (--stop_at_eot: stop at the config's EoT); every other own
field's flag has its name."""


def knobs(sampler: registry.Sampler) -> set[str]:
  """The sampler-specific flags `sampler` takes: the common settings it reads (`SHARED_FLAGS` aside) and its
  own variant and schedule fields (`dlm_jax.sampling.registry`)."""
  own = sampler.variant_fields + sampler.schedule_fields
  return ({name for name in sampler.common_fields if name not in SHARED_FLAGS}
          | {FLAG_OF_FIELD.get(field, field) for field in own})


@dataclasses.dataclass(frozen=True)
class Settings:
  """One generation: the sampler, its knobs (defaults resolved), the prompt and the numerics."""

  checkpoint: str
  sampler: str
  prompt_ids: tuple[int, ...]
  gen_length: int
  steps: int | None
  block_length: int | None
  temperature: float
  remasking: str
  cfg_scale: float
  logits_eos_inf: bool
  confidence_eos_eot_inf: bool
  stop_at_eot: bool
  alg: str
  alg_temp: float | None
  top_p: float | None
  top_k: int | None
  eps: float
  seed: int
  mask_sinks: int
  end_of_turn_id: int | None
  editing_threshold: float | None
  max_post_steps: int
  numerics: Numerics
  entropy_bound: float = 0.1
  t_min: float = 0.4
  t_max: float = 0.8
  confidence_threshold: float = 0.005
  stability_threshold: int = 1
  decoding: DecodingMode = DecodingMode()
  stop_at_eos: bool = True

  def __post_init__(self):
    lengths = {name: getattr(self, name) for name in ("gen_length", "steps", "block_length", "top_k")}
    flag_checks.positive(**{name: value for name, value in lengths.items() if value is not None})
    size_limits.check(gen_length=self.gen_length, steps=self.steps, block_length=self.block_length, top_k=self.top_k,
                      mask_sinks=self.mask_sinks, max_post_steps=self.max_post_steps,
                      stability_threshold=self.stability_threshold)
    if self.temperature < 0:
      raise cli.UserError(f"--temperature={self.temperature}: expected >= 0 (0 = argmax)")
    if self.cfg_scale < 0:
      raise cli.UserError(f"--cfg_scale={self.cfg_scale}: expected >= 0 (0 = no guidance)")
    if self.top_p is not None and not 0 < self.top_p <= 1:
      raise cli.UserError(f"--top_p={self.top_p}: expected a value in (0, 1]")
    if self.alg_temp is not None and self.alg_temp < 0:
      raise cli.UserError(f"--alg_temp={self.alg_temp}: expected >= 0")
    if not 0 < self.eps < 1:
      raise cli.UserError(f"--eps={self.eps}: expected a value in (0, 1)")
    if self.mask_sinks < 0:
      raise cli.UserError(f"--mask_sinks={self.mask_sinks}: expected >= 0 (0 = off)")
    sampler = registry.get(self.sampler)
    if "confidence_threshold" in knobs(sampler) and self.confidence_threshold < 0:
      raise cli.UserError(f"--confidence_threshold={self.confidence_threshold}: expected >= 0 (0 = no adaptive "
                          "stopping)")
    sampler_options.check_fit("", self.sampler, self.decoding, gen_length=self.gen_length, steps=self.steps,
                              block_length=self.block_length, cfg_scale=self.cfg_scale)

  def options(self, config):
    """The library options of these settings (`dlm_jax.session.sampler_options.options`: the decoding mode's
    fields, the block length of the sampler's block rule, the autoregressive end ids; a one-line error for a
    decoding mode the sampler lacks), with its own variant and schedule fields (`knobs`)."""
    common = registry.CommonSettings(
        gen_length=self.gen_length, steps=self.steps, block_length=self.block_length, temperature=self.temperature,
        top_p=self.top_p, top_k=self.top_k, cfg_scale=self.cfg_scale, remasking=self.remasking, alg=self.alg,
        alg_temp=self.alg_temp, eps=self.eps)
    sampler = registry.get(self.sampler)
    own = {field: self._own_value(field, config) for field in sampler.variant_fields + sampler.schedule_fields}
    return sampler_options.options(self.sampler, common, self.decoding, own, config=config,
                                   end_ids=tuple(end_ids(config, self.end_of_turn_id)), stop_at_eos=self.stop_at_eos)

  def _own_value(self, field: str, config):
    """One own options field's value: its flag's, except stop_token_id (--stop_at_eot: the config's EoT id, else
    None) and confidence_threshold (0 = None: no adaptive stopping)."""
    if field == "stop_token_id":
      return config.eot_token_id if self.stop_at_eot else None
    if field == "confidence_threshold":
      return self.confidence_threshold or None
    return getattr(self, field)


def end_ids(config, end_of_turn_id: int | None) -> set[int]:
  """The ids that end a reply: EOS, EoT and the chat template's end-of-turn token (when known)."""
  return {config.eos_token_id, config.eot_token_id, end_of_turn_id} - {None}


def _warn_unused_knobs(sampler: str) -> None:
  """Warns about sampler-specific flags given for a sampler that does not have them (they are ignored), and
  about --temperature given for a sampler that runs its own temperature schedule."""
  every = {s.name: knobs(s) for s in registry.SAMPLERS.values()}
  for name in sorted(set().union(*every.values()) - every[sampler]):
    if flags.FLAGS[name].present:
      owners = ", ".join(s for s in every if name in every[s])
      logging.warning("--%s applies to --sampler=%s only; ignored for %s", name, owners, sampler)
  schedule = registry.get(sampler).temperature_schedule
  if schedule and flags.FLAGS["temperature"].present:
    logging.warning("--temperature does not apply to %s (its schedule runs from --%s to --%s); ignored", sampler,
                    *schedule)


def prompt_format(directory: str, record: dict) -> str:
  """--prompt_format with auto resolved (module docstring); refuses --chat with another format."""
  chosen = _PROMPT_FORMAT.value
  if _CHAT.value:
    if chosen not in ("auto", "chat"):
      raise cli.UsageError(f"--chat is --prompt_format=chat; it contradicts --prompt_format={chosen}")
    return "chat"
  return prompt_layout.resolve(chosen, directory, record)


def _prompt_ids(config, tokenizer, directory: str, sampler: str, layout: str) -> tuple[list[int], int | None]:
  """(prompt ids, the end-of-turn id of a chat prompt or None)."""
  if (_PROMPT.value is None) == (_PROMPT_IDS.value is None):
    raise cli.UsageError("give exactly one of --prompt and --prompt_ids")
  if _PROMPT_IDS.value is not None:
    if _CHAT.value or _PROMPT_FORMAT.present:
      raise cli.UsageError("--chat and --prompt_format lay out --prompt text, not --prompt_ids")
    try:
      ids = [int(t) for t in _PROMPT_IDS.value.split(",") if t.strip()]
    except ValueError:
      raise cli.UsageError(f"--prompt_ids must be comma-separated integers, got {_PROMPT_IDS.value!r}") from None
    bad = [i for i in ids if not 0 <= i < config.vocab_size]
    if not ids or bad:
      raise cli.UserError(f"--prompt_ids must be non-empty ids in [0, {config.vocab_size}); got {bad or 'none'}")
    return ids, None
  if not _PROMPT.value.strip():
    raise cli.UsageError(f"--prompt={_PROMPT.value!r} is empty; give the text to answer or continue, or "
                         "--prompt_ids with the ids to start from (e.g. the BOS id alone)")
  if tokenizer is None:
    raise cli.UserError(f"--prompt needs tokenizer files in {directory}; use --prompt_ids")
  end = None
  if layout == "training":  # the experiment binaries' prompts (`experiments.common.prompts`): pads, BOS, width check
    model = checkpoints.prepare(_CHECKPOINT.value, sampler, "training")
    ids = prompts.encode(model, [items.Item("--prompt", _PROMPT.value, None, "gsm8k")]).sequences["--prompt"]
  elif layout == "chat":
    form = chat.chat_format(directory, sampler, _TEMPLATE.value)
    bos = None if config.bos_token_id is None else tokenizer.id_to_token(config.bos_token_id)
    ids = tokenizer.encode(form.text(_PROMPT.value, bos))
    end = tokenizer.token_to_id(form.end_of_turn)
  else:
    bos = [config.bos_token_id] if layout == "plain" and config.bos_token_id is not None else []
    ids = bos + tokenizer.encode(_PROMPT.value)
  chat.warn_unknown_tokens(tokenizer, ids, "--prompt")
  if not ids:
    raise cli.UserError("--prompt encodes to no tokens")
  return ids, end


def training_defaults(record: dict, sampler: str) -> dict[str, int]:
  """gen_length, steps and block_length of the training layout: the training answer width, one block."""
  data = record["data"]
  width = int(data["seq_len"]) - int(data["prompt_len"])
  if registry.get(sampler).kind == "causal":
    return {"gen_length": width}
  return {"gen_length": width, "steps": width, "block_length": width}


def check_training_width(label: str, record: dict, prompt_length: int, gen_length: int) -> None:
  """Refuses a prompt wider than the recorded training prompt width, or a prompt plus gen_length longer than
  the recorded training sequence (a front extra sink token adds one position to both)."""
  data = record.get("data", {})
  sink = 1 if record.get("train_config", {}).get("sink") == "front" else 0
  if data.get("prompt_len") and prompt_length > int(data["prompt_len"]) + sink:
    raise cli.UserError(f"{label}: the prompt has {prompt_length} tokens; the model was trained with prompts of at "
                        f"most {int(data['prompt_len']) + sink} (training.json prompt_len)")
  if data.get("seq_len") and prompt_length + gen_length > int(data["seq_len"]) + sink:
    longest = int(data["seq_len"]) + sink
    raise cli.UserError(f"{label}: the prompt ({prompt_length} tokens) and --gen_length={gen_length} make "
                        f"{prompt_length + gen_length} positions; the model was trained on sequences of {longest} "
                        f"(training.json seq_len); use --gen_length of at most {longest - prompt_length}")


def _intervention(sampler: str, top_k: int):
  from dlm_jax.instrument import interventions  # pylint: disable=import-outside-toplevel
  if top_k <= 0:
    return interventions.NO_INTERVENTION
  if registry.get(sampler).kind == "causal":
    return interventions.MaskPreviousSinksAR(top_k=top_k)
  return interventions.MaskPreviousSinks(top_k=top_k)


def _generate(params, config, settings: Settings, prompt, stats_spec):
  return registry.get(settings.sampler).generate(
      params, prompt, config=config, options=settings.options(config), key=jax.random.key(settings.seed),
      setup=RunSetup(stats_spec=stats_spec, intervention=_intervention(settings.sampler, settings.mask_sinks),
                     attention_impl=settings.numerics.attention_impl, query_chunk=settings.numerics.query_chunk,
                     batch_invariant=settings.numerics.batch_invariant, policy=settings.decoding.compute_policy()))


def reply_text(tokenizer, generated: list[int], end_ids: set[int]) -> str:
  """The generated ids up to the first of `end_ids` (none: all of them), decoded without special tokens."""
  cut = next((i for i, t in enumerate(generated) if t in end_ids), len(generated))
  return tokenizer.decode(generated[:cut], skip_special_tokens=True)


def main(argv):
  del argv
  from dlm_jax.io import checkpoint  # pylint: disable=import-outside-toplevel
  from dlm_jax.instrument.stats import NO_STATS, StatsSpec  # pylint: disable=import-outside-toplevel
  from dlm_jax.io.tokenizer import Tokenizer  # pylint: disable=import-outside-toplevel
  runtime_settings = runtime_flags.from_flags()
  if _JSON_OUT.value:
    run_dir.check_output_file(_JSON_OUT.value, "json_out")
  if _STATS_OUT.value:
    run_dir.check_output_file(_STATS_OUT.value, "stats_out")
  label, directory = checkpoints.resolve(_CHECKPOINT.value)
  config = checkpoint.read_config(directory)
  record = training_record.read(directory)
  sampler = checkpoint_bundle.default_sampler(config) if _SAMPLER.value == "auto" else _SAMPLER.value
  checkpoint_bundle.check_sampler(_CHECKPOINT.value, sampler, config)
  _warn_unused_knobs(sampler)
  mode = decoding_flags.from_flags()
  decoding.warn_if_unused(mode, sampler, _CHECKPOINT.value)
  tokenizer = Tokenizer.from_dir(directory, config) if Tokenizer.exists_in(directory) else None
  mode.check_tokenizer(tokenizer)
  layout = "ids" if _PROMPT_IDS.value is not None else prompt_format(directory, record)
  ids, end_of_turn = _prompt_ids(config, tokenizer, directory, sampler, layout)
  runtime = devices.init_runtime(runtime_settings)
  given = {"gen_length": _GEN_LENGTH.value, "steps": _STEPS.value, "block_length": _BLOCK_LENGTH.value}
  decoder = registry.get(sampler)
  applies = knobs(decoder) | {"gen_length"}
  defaults = training_defaults(record, sampler) if layout == "training" else {}
  values = {k: v if v is not None and k in applies else defaults.get(k, getattr(decoder.defaults, k))
            for k, v in given.items()}
  check_training_width(label, record, len(ids), values["gen_length"])
  if mode.policy != "none" and not decoder.has_modes:
    raise CombinationError(f"--policy={mode.policy} runs with the masked diffusion samplers (LLaDA, MMaDA, Dream; "
                           "sparse_dllm also with block_diffusion), "
                           f"not the {sampler} sampler")
  settings = Settings(
      checkpoint=directory, sampler=sampler, prompt_ids=tuple(ids),
      gen_length=values["gen_length"], steps=values["steps"], block_length=values["block_length"],
      temperature=_TEMPERATURE.value, remasking=_REMASKING.value, cfg_scale=_CFG_SCALE.value,
      logits_eos_inf=_LOGITS_EOS_INF.value, confidence_eos_eot_inf=_CONF_EOS_EOT_INF.value,
      stop_at_eot=_STOP_AT_EOT.value, alg=_ALG.value, alg_temp=_ALG_TEMP.value, top_p=_TOP_P.value,
      top_k=_TOP_K.value, eps=_EPS.value, seed=_SEED.value, mask_sinks=_MASK_SINKS.value,
      end_of_turn_id=end_of_turn, editing_threshold=_EDITING_THRESHOLD.value, max_post_steps=_MAX_POST_STEPS.value,
      numerics=numerics_flags.from_flags(runtime_settings),
      decoding=mode if decoder.has_modes else DecodingMode(),
      entropy_bound=_ENTROPY_BOUND.value, t_min=_T_MIN.value, t_max=_T_MAX.value,
      confidence_threshold=_CONFIDENCE_THRESHOLD.value, stability_threshold=_STABILITY_THRESHOLD.value,
      stop_at_eos=_STOP_AT_EOS.value)
  try:
    settings.options(config)
  except SessionError:
    raise
  except ValueError as e:
    raise cli.UserError(str(e)) from None
  size_limits.check_sequence(len(ids), settings.gen_length, config.vocab_size, 2 if settings.cfg_scale > 0 else 1)
  config, params = checkpoint_bundle.load_params(directory, runtime.mesh, settings.numerics.weight_dtype)
  stats_spec = (StatsSpec(incoming_attention=True, per_head=True, routing=config.is_moe) if _STATS_OUT.value
                else NO_STATS)
  prompt = devices.replicate(np.asarray([ids], np.int32), runtime)
  start = time.perf_counter()
  trace = distributed.to_host(_generate(params, config, settings, prompt, stats_spec))
  wall_s = time.perf_counter() - start
  decoding.check_finite(trace, ["the prompt"])
  if not runtime.primary:
    return
  tokens = [int(t) for t in np.asarray(trace.tokens)[0]]
  result = {"tokens": tokens, "prompt_length": int(trace.prompt_length),
            "decode_step": [int(s) for s in np.asarray(trace.decode_step)[0]], "nfe": int(trace.nfe),
            "row_nfe": int(np.asarray(trace.row_nfe)[0]), "decoding": settings.decoding.spec, "sampler": sampler,
            "prompt_format": layout, "wall_s": wall_s, "settings": dataclasses.asdict(settings)}
  # The first gen_length tokens: blocks of the model's attention run on past it (LLaDA2's answer ends there).
  reply = tokens[trace.prompt_length:][:settings.gen_length]
  ends = end_ids(config, end_of_turn) if settings.stop_at_eos else set()
  if getattr(settings.options(config), "eos_stop", False):  # the sampler stops at EOS; pad follows it
    ends |= {config.eos_token_id} - {None}
  if tokenizer is not None:
    result["text"] = reply_text(tokenizer, reply, ends)
  if _JSON_OUT.value:
    atomic_files.atomic_write_bytes(_JSON_OUT.value, (json.dumps(result) + "\n").encode())
  if _STATS_OUT.value:
    nfe = int(trace.nfe)  # the steps run; the buffers' later entries are zeros
    incoming = np.asarray(trace.stats["incoming_attention"][:nfe, :, 0], np.float32)  # [nfe, L, N, S]
    routing = {}
    if config.is_moe:  # row 0's router choice per step, layer and position (expert -1: none)
      routing = {name: np.asarray(trace.stats[name][:nfe, :, 0]) for name in ("routed_experts", "routing_weights")}
    extra = {}
    if trace.accepted is not None:  # DiffusionGemma: the canvas positions each decoder step accepted
      extra["accepted"] = np.asarray(trace.accepted[:nfe, 0])
    atomic_files.write_npz(_STATS_OUT.value, incoming_attention=incoming,
                           computed_queries=np.asarray(trace.computed_queries[:nfe], np.int32), **routing, **extra)
  n_reply = next((i for i, t in enumerate(reply) if t in ends), len(reply))
  print(result["text"] if tokenizer is not None else " ".join(map(str, reply[:n_reply])))
  written = [path for path in (_JSON_OUT.value, _STATS_OUT.value) if path]
  print(f"[{label} · {sampler} · {layout} prompt of {len(ids)} tokens · {n_reply} generated tokens · NFE "
        f"{result['nfe']} · {wall_s:.2f} s{' · wrote ' + ', '.join(written) if written else ''}]")


if __name__ == "__main__":
  cli.run(main)
