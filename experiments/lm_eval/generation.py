"""`generate_until` of the `dlm_jax` model: requests grouped by their resolved decoding values, batched
through the compiled samplers (`experiments.common.decoding.generate`), cut at the stop ids then at the first
`until` string, and returned in lm-eval's order.

Per request: the task's preset values (`EvalArgs.for_task`), then the request's generation kwargs —
`until` (a string or a list), `max_gen_toks` (the generation length when model_args and the preset give
none), `temperature`, `do_sample` (False = temperature 0), `top_p`, `top_k`; other kwargs are ignored
with a warning. Prompts of a batch are left-padded to a multiple of 32 (`dlm_jax.session.decode_settings`'
invariant padding: pad keys hidden, positions shifted) and every row's PRNG key derives from the seed
and the request (`decoding.batch_key`), so a request's text does not depend on the batch it lands in
beyond float32 reduction order. mask_sinks = K > 0 runs the sampler under `MaskPreviousSinks(K)`
(`MaskPreviousSinksAR` for causal models) composed after the checkpoint's own sink token; steer = FILE adds
the steering file's vectors at their sites inside the sampler (`dlm_jax.session.steering_file`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import types
from typing import Any, Sequence

import numpy as np

from dlm_jax.instrument import interventions
from dlm_jax.runtime import distributed
from dlm_jax import session
from dlm_jax.session import SessionError, steering_file
from dlm_jax.session.decode_settings import DecodeSettings
from experiments.common import decoding, prompts
from experiments.common.cli import UserError
from experiments.lm_eval.args import EvalArgs

LOG = logging.getLogger(__name__)
WIDTH_MULTIPLE = 32
KNOWN_KWARGS = {"until", "max_gen_toks", "temperature", "do_sample", "top_p", "top_k"}


def stop_strings(gen_kwargs: dict[str, Any]) -> list[str]:
  """The request's `until` as a list of non-empty strings."""
  until = gen_kwargs.get("until") or []
  until = [until] if isinstance(until, str) else list(until)
  return [u for u in until if u]


def cut_at_stops(text: str, until: Sequence[str]) -> str:
  """`text` up to the earliest occurrence of any stop string."""
  cut = min((text.find(u) for u in until if u in text), default=len(text))
  return text[:cut]


def decode_settings(args: EvalArgs, gen_kwargs: dict[str, Any]) -> DecodeSettings:
  """The decoding flags of one request (module docstring)."""
  unknown = sorted(set(gen_kwargs) - KNOWN_KWARGS)
  if unknown:
    LOG.warning("dlm_jax: generation kwargs %s are not used", ", ".join(unknown))
  temperature = float(gen_kwargs.get("temperature", args.temperature))
  if gen_kwargs.get("do_sample") is False:
    temperature = 0.0
  gen_length = args.gen_length or (int(gen_kwargs["max_gen_toks"]) if "max_gen_toks" in gen_kwargs else None)
  top_k = gen_kwargs.get("top_k", args.top_k)
  try:
    return DecodeSettings(gen_length=gen_length, steps=args.steps, block_length=args.block_length,
                          temperature=temperature, cfg_scale=args.cfg, remasking=args.remasking, alg=args.alg,
                          alg_temp=args.alg_temp, top_p=gen_kwargs.get("top_p", args.top_p),
                          top_k=None if top_k is None else int(top_k), padding="invariant", seed=args.seed)
  except SessionError as e:
    raise UserError(f"generation kwargs {gen_kwargs}: {e}") from None


def _masker(model):
  if model.diffusion:
    return interventions.MaskPreviousSinks(top_k=1)
  return interventions.MaskPreviousSinksAR(top_k=1)


def run_batch(model, values: dict[str, Any], ids: list[list[int]], item_ids: list[str], args: EvalArgs, runtime,
              numerics) -> list[list[int]]:
  """Generated ids of each prompt (cut at the model's stop ids): ids per request, item_ids their key ids."""
  rows = runtime.round_batch(max(args.batch_size, len(ids)))
  width = -(-max(len(i) for i in ids) // WIDTH_MULTIPLE) * WIDTH_MULTIPLE
  items = [types.SimpleNamespace(id=str(n)) for n in range(len(ids))]
  prompt_set = prompts.PromptSet({str(n): row for n, row in enumerate(ids)}, width, prompts.pad_id(model),
                                 masked=any(len(row) < width for row in ids))
  batch = prompts.batch(prompt_set, items, rows)
  key = decoding.batch_key(args.seed, item_ids + [item_ids[-1]] * (rows - len(ids)))
  intervention, state = None, None
  if args.mask_sinks:
    masker = _masker(model)
    intervention = decoding.combined_intervention(model, masker)
    total = width + values["gen_length"]
    valid = np.ones((rows, total), bool)
    if batch.mask is not None:
      valid[:, :width] = batch.mask
    state = decoding.masker_state(model, intervention, masker, rows, total, args.mask_sinks, valid)
  hooks, hook_values = None, None
  if args.steer:
    try:
      hooks, hook_values = steering_file.steering(args.steer, model.config, rows, width + values["gen_length"])
    except SessionError as e:
      raise UserError(str(e)) from None
  trace = decoding.generate(model, values, batch, runtime, numerics, key=key, intervention=intervention,
                            intervention_state=state, hooks=hooks, hook_values=hook_values)
  generated = np.asarray(distributed.to_host(trace.generated))
  stops = prompts.end_ids(model)
  out = []
  for row in generated[:len(ids)].tolist():
    cut = next((i for i, t in enumerate(row) if t in stops), len(row))
    out.append(row[:cut])
  return out


def generate_until(lm, requests) -> list[str]:
  """lm: the `DlmJaxLM`; requests: lm-eval Instances with args (context, gen_kwargs)."""
  groups: dict[str, list[int]] = {}
  resolved = {}
  for index, request in enumerate(requests):
    context, gen_kwargs = request.args
    args = lm.args.for_task(request.task_name)
    try:
      values = session.model_settings(decode_settings(args, dict(gen_kwargs)), lm.model, args.mode)
    except SessionError as e:
      raise UserError(str(e)) from None
    ids = lm.context_ids(context, reserve=values["gen_length"])
    resolved[index] = (args, values, ids, stop_strings(gen_kwargs))
    groups.setdefault(json.dumps([dataclasses.asdict(args) | {"given": None}, values], sort_keys=True,
                                 default=str), []).append(index)
  results: list[str | None] = [None] * len(requests)
  for members in groups.values():
    args, values = resolved[members[0]][:2]
    members = sorted(members, key=lambda i: len(resolved[i][2]))
    for start in range(0, len(members), args.batch_size):
      chunk = members[start:start + args.batch_size]
      item_ids = [json.dumps([requests[i].args[0], stop_strings(requests[i].args[1])]) for i in chunk]
      generated = run_batch(lm.model, values, [resolved[i][2] for i in chunk], item_ids, args, lm.runtime,
                            lm.numerics)
      for i, row in zip(chunk, generated):
        text = cut_at_stops(lm.model.tokenizer.decode(row, skip_special_tokens=True), resolved[i][3])
        results[i] = text
        lm.cache_hook.add_partial("generate_until", requests[i].args, text)
  return results
