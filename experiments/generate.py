"""Generates from a converted checkpoint with one of the compiled samplers and writes the trace.

  python -m experiments.generate --checkpoint=DIR (--prompt=TEXT [--chat] | --prompt_ids=1,2,3) \
      --sampler=llada|mmada|dream|ar --gen_length=N --steps=N --block_length=N --temperature=T \
      --remasking=low_confidence|random --cfg_scale=W --alg=origin|maskgit_plus|topk_margin|entropy \
      --alg_temp=T --top_p=P --top_k=K --eps=E --seed=S --json_out=FILE [--stats_out=FILE.npz] [--mask_sinks=K]

JSON (written atomically): tokens (the whole sequence, prompt included), prompt_length, decode_step (per
generated position, the 0-based step at which it was unmasked; for `ar` the step that produced it), nfe,
and text (the generated part, special tokens skipped) when the checkpoint has a tokenizer.
NPZ (--stats_out): incoming_attention [steps, L, N, S] float32 for batch row 0: entry [t, l, n, j] is the
sum over all queries of the attention key j receives in layer l, head n, during the model call of step t
(with CFG, the conditional call).
--mask_sinks=K > 0 masks, at every step, the top-K sinks of the previous step
(`dlm_jax.interventions.MaskPreviousSinks(top_k=K)`; `MaskPreviousSinksAR` for --sampler=ar).
The shared flags of `experiments.common` apply: --mesh (parameters sharded over fsdp/tensor; the one
prompt is replicated), --distributed, --cpu_devices, --dtype (default float32 on CPU, stored dtype on
accelerators), --matmul_precision (default highest).
"""

from __future__ import annotations

import io
import json

import jax
import numpy as np
from absl import app, flags

from dlm_jax import distributed
from experiments import common, devices

_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "Converted checkpoint directory.", required=True)
_PROMPT = flags.DEFINE_string("prompt", None, "Prompt text (needs the checkpoint's tokenizer).")
_CHAT = flags.DEFINE_bool("chat", False, "Wrap --prompt as one user turn in the sampler's chat template.")
_TEMPLATE = flags.DEFINE_enum("template", None, ["llada", "mmada", "dream", "llama3"],
                              "Chat template (default: llada, mmada, dream or llama3 by --sampler).")
_PROMPT_IDS = flags.DEFINE_string("prompt_ids", None, "Comma-separated prompt token ids.")
_SAMPLER = flags.DEFINE_enum("sampler", None, ["llada", "mmada", "dream", "ar"], "Sampler.", required=True)
_GEN_LENGTH = flags.DEFINE_integer("gen_length", 128, "Generated positions (Dream: max_new_tokens).")
_STEPS = flags.DEFINE_integer("steps", 128, "Denoising steps (diffusion samplers).")
_BLOCK_LENGTH = flags.DEFINE_integer("block_length", None, "LLaDA/MMaDA block length (default: gen_length).")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "Sampling temperature (0 = argmax).")
_REMASKING = flags.DEFINE_enum("remasking", "low_confidence", ["low_confidence", "random"], "LLaDA remasking.")
_CFG_SCALE = flags.DEFINE_float("cfg_scale", 0.0, "LLaDA/MMaDA classifier-free guidance weight.")
_LOGITS_EOS_INF = flags.DEFINE_bool("logits_eos_inf", False, "LLaDA: EOS is never sampled.")
_CONF_EOS_EOT_INF = flags.DEFINE_bool("confidence_eos_eot_inf", False, "LLaDA: the official EOS/EoT confidence rule.")
_STOP_AT_EOT = flags.DEFINE_bool("stop_at_eot", False, "MMaDA mmu_generate_fast: stop when a block ends in EoT.")
_ALG = flags.DEFINE_enum("alg", "origin", ["origin", "maskgit_plus", "topk_margin", "entropy"], "Dream alg.")
_ALG_TEMP = flags.DEFINE_float("alg_temp", None, "Dream alg_temp (None/0 = deterministic positions).")
_TOP_P = flags.DEFINE_float("top_p", None, "Top-p filtering (Dream, ar).")
_TOP_K = flags.DEFINE_integer("top_k", None, "Top-k filtering (Dream, ar).")
_EPS = flags.DEFINE_float("eps", 1e-3, "Dream's last timestep.")
_SEED = flags.DEFINE_integer("seed", 0, "PRNG seed.")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Output JSON file.", required=True)
_STATS_OUT = flags.DEFINE_string("stats_out", None, "Optional .npz with per-step incoming attention.")
_MASK_SINKS = flags.DEFINE_integer("mask_sinks", 0, "Mask the previous step's top-K sinks (0 = off).")

_DEFAULT_TEMPLATE = {"llada": "llada", "mmada": "mmada", "dream": "dream", "ar": "llama3"}


def _prompt_ids(config, tokenizer) -> list[int]:
  if (_PROMPT.value is None) == (_PROMPT_IDS.value is None):
    raise app.UsageError("Give exactly one of --prompt and --prompt_ids.")
  if _PROMPT_IDS.value is not None:
    try:
      ids = [int(t) for t in _PROMPT_IDS.value.split(",") if t.strip()]
    except ValueError:
      raise app.UsageError(f"--prompt_ids must be comma-separated integers, got {_PROMPT_IDS.value!r}.") from None
    if not ids or any(not 0 <= i < config.vocab_size for i in ids):
      raise app.UsageError(f"--prompt_ids must be non-empty ids in [0, {config.vocab_size}).")
    return ids
  if tokenizer is None:
    raise app.UsageError(f"--prompt needs tokenizer files in {_CHECKPOINT.value}; use --prompt_ids.")
  if _CHAT.value:
    template = _TEMPLATE.value or _DEFAULT_TEMPLATE[_SAMPLER.value]
    return tokenizer.apply_chat_template([{"role": "user", "content": _PROMPT.value}], template)
  return tokenizer.encode(_PROMPT.value)


def _intervention(config):
  if _MASK_SINKS.value <= 0:
    from dlm_jax.interventions import NO_INTERVENTION
    return NO_INTERVENTION
  from dlm_jax import interventions
  if _SAMPLER.value == "ar" and hasattr(interventions, "MaskPreviousSinksAR"):
    return interventions.MaskPreviousSinksAR(top_k=_MASK_SINKS.value)
  return interventions.MaskPreviousSinks(top_k=_MASK_SINKS.value)


def _run_sampler(params, config, prompt, key, stats_spec, intervention):
  from dlm_jax.sampling import autoregressive, dream, llada
  common = dict(config=config, key=key, stats_spec=stats_spec, intervention=intervention)
  sampler = _SAMPLER.value
  if sampler in ("llada", "mmada"):
    values = dict(gen_length=_GEN_LENGTH.value, steps=_STEPS.value, block_length=_BLOCK_LENGTH.value,
                  temperature=_TEMPERATURE.value, cfg_scale=_CFG_SCALE.value, remasking=_REMASKING.value)
    if sampler == "llada":
      options = llada.LLaDAOptions(logits_eos_inf=_LOGITS_EOS_INF.value,
                                   confidence_eos_eot_inf=_CONF_EOS_EOT_INF.value, **values)
    else:
      stop = config.eot_token_id if _STOP_AT_EOT.value else None
      options = llada.mmada_options(stop_token_id=stop, **values)
    return llada.generate(params, prompt, options=options, **common)
  if sampler == "dream":
    options = dream.DreamOptions(gen_length=_GEN_LENGTH.value, steps=_STEPS.value, eps=_EPS.value, alg=_ALG.value,
                                 alg_temp=_ALG_TEMP.value, temperature=_TEMPERATURE.value, top_p=_TOP_P.value,
                                 top_k=_TOP_K.value)
    return dream.diffusion_generate(params, prompt, options=options, **common)
  options = autoregressive.AROptions(gen_length=_GEN_LENGTH.value, temperature=_TEMPERATURE.value,
                                     top_k=_TOP_K.value, top_p=_TOP_P.value)
  return autoregressive.generate(params, prompt, options=options, **common)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  runtime = devices.init_runtime()
  from dlm_jax.stats import NO_STATS, StatsSpec
  from dlm_jax.tokenizer import Tokenizer

  config, params = common.load_params(_CHECKPOINT.value, runtime, common.weight_dtype())
  tokenizer = Tokenizer.from_dir(_CHECKPOINT.value, config) if Tokenizer.exists_in(_CHECKPOINT.value) else None
  ids = _prompt_ids(config, tokenizer)
  stats_spec = StatsSpec(incoming_attention=True, per_head=True) if _STATS_OUT.value else NO_STATS
  try:
    prompt = devices.replicate(np.asarray([ids], np.int32), runtime)
    trace = _run_sampler(params, config, prompt, jax.random.key(_SEED.value), stats_spec, _intervention(config))
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  trace = distributed.to_host(trace)
  if not runtime.primary:
    return
  tokens = np.asarray(trace.tokens)[0]
  result = {"tokens": [int(t) for t in tokens], "prompt_length": int(trace.prompt_length),
            "decode_step": [int(s) for s in np.asarray(trace.decode_step)[0]], "nfe": int(trace.nfe),
            "sampler": _SAMPLER.value}
  if tokenizer is not None:
    result["text"] = tokenizer.decode(tokens[trace.prompt_length:])
  common.atomic_write_bytes(_JSON_OUT.value, (json.dumps(result) + "\n").encode())
  if _STATS_OUT.value:
    incoming = np.asarray(trace.stats["incoming_attention"][:, :, 0], np.float32)  # [steps, L, N, S]
    buffer = io.BytesIO()
    np.savez(buffer, incoming_attention=incoming)
    common.atomic_write_bytes(_STATS_OUT.value, buffer.getvalue())


if __name__ == "__main__":
  app.run(main)
