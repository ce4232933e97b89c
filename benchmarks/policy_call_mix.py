"""Which calls a compute policy's steps are made of, and how many tokens a call commits, measured on the embedded
tiny-dlm (`benchmarks.policy_bench` combines them with the per-call times it measures at the LLaDA-8B shape).

Random weights give no meaningful confidences, so what depends on the model's predictions is measured on a
trained model: tiny-dlm on its synthetic task (prompt 36, 32 generated positions in one block of 32 — the 8B
benchmark's block length —, one prompt per run, so each row's calls are its own). A run is the LLaDA sampler
under a policy with exact decoding (steps = 32) or Fast-dLLM's threshold rule, optionally with Fast-dLLM's dual
cache. Each model call of a run is classified into the benchmark's calls (`benchmarks.policy_calls`) from the
run's `Trace`, as weights that sum to 1:

  no policy                  exact (a full call; the dual cache: its block's first call `full`, then `dual_cache`);
  dkv_cache / sparse_dllm    full when the call computed every position, else dkv_subset / sparse_subset;
                             Sparse-dLLM with the dual cache: a block's call 1 (the block over all S cached keys,
                             the call that scores them) `dual_cache`;
  sparsed                    full when its queries read all S keys, else sparsed_blocks;
  dllm_cache                 reuse_<case>: whether layer 1 on recomputed the whole prompt / the whole response
                             (its `Trace.policy_record`);
  elastic_cache              elastic_full_refresh with weight (L − start) / L, the share of the layers the call
                             recomputed for every position (its record's refresh_start), elastic_no_refresh the rest;
  d2cache                    full at a full call (every position), else d2cache_S/2^k, its record's row bucket.

A policy the sampler refuses with that decoding is recorded with the refusal's one line.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from benchmarks.policy_calls import layout
from dlm_jax.policy.base import PolicyError
from dlm_jax.policy.registry import parse_policy
from dlm_jax.sampling import llada
from dlm_jax.session import checkpoint_bundle
from experiments.common import checkpoints, items, prompts
from dlm_jax.sampling.run_setup import RunSetup

GEN_LENGTH = BLOCK_LENGTH = 32
"""tiny-dlm's answer length (its training layout), decoded in one block of the 8B benchmark's length."""


@dataclasses.dataclass(frozen=True)
class Condition:
  """A decoding: policy text ("none" or `parse_policy`'s), threshold (None: exact decoding, one token per step),
  cache ("none" or "dual")."""

  policy: str
  threshold: float | None = None
  cache: str = "none"


def classify(name: str, trace, step: int, seq_len: int, prompt_length: int, n_layers: int,
             buckets: tuple[int, ...] = ()) -> dict[str, float]:
  """{benchmark call: weight} of call `step` of a one-row run of policy `name` (module docstring)."""
  if trace.computed_positions is None:
    return {"exact": 1.0}
  computed = np.asarray(trace.computed_positions)[step, 0]
  record = None if trace.policy_record is None else trace.policy_record
  if (name == "sparse_dllm" and not computed.all() and trace.keys_read is not None
      and float(np.asarray(trace.keys_read)[step, 0]) >= seq_len):
    return {"dual_cache": 1.0}
  if name in ("dkv_cache", "sparse_dllm"):
    return {"full" if computed.all() else {"dkv_cache": "dkv_subset", "sparse_dllm": "sparse_subset"}[name]: 1.0}
  if name == "sparsed":
    return {"full" if float(np.asarray(trace.keys_read)[step, 0]) >= seq_len else "sparsed_blocks": 1.0}
  if name == "dllm_cache":
    layers = np.asarray(record)[step, 0, 1:]  # [L − 1, S]
    prompt, gen = bool(layers[:, :prompt_length].all()), bool(layers[:, prompt_length:].all())
    return {f"reuse_{'both' if prompt and gen else 'prompt' if prompt else 'gen' if gen else 'none'}": 1.0}
  if name == "elastic_cache":
    start = int(np.asarray(record["refresh_start"])[step, 0])
    share = (n_layers - min(start, n_layers)) / n_layers
    return {"elastic_full_refresh": share, "elastic_no_refresh": 1.0 - share}
  if name == "d2cache":
    if step == 0:  # d2Cache's full call
      return {"full": 1.0}
    rows = int(np.asarray(record["rows"])[step, 0])
    return {f"d2cache_S/{2 ** (len(buckets) - 1 - buckets.index(rows))}": 1.0}
  raise ValueError(f"no call classification for policy {name!r}")


def measure(conditions: list[Condition], n_prompts: int) -> dict[Condition, dict]:
  """{condition: {"calls": model calls, "tokens": positions decoded, "tokens_per_call", "mix": {call: share of
  the calls}, "mix_after_first": the same without each run's first call} or {"refused": one line}} over the
  first n_prompts synthetic test problems."""
  model = checkpoint_bundle.load_weights(checkpoints.prepare("tiny-dlm", "auto", "auto"))
  todo = items.load_items("synthetic", n_prompts, 0)
  prompt_set = prompts.encode(model, todo)
  results = {}
  for condition in conditions:
    options = llada.LLaDAOptions(gen_length=GEN_LENGTH, steps=GEN_LENGTH, block_length=BLOCK_LENGTH,
                                 threshold=condition.threshold, cache=condition.cache)
    policy = parse_policy(condition.policy)
    mix, later, calls = collections.Counter(), collections.Counter(), 0
    try:
      for item in todo:
        ids = prompts.batch(prompt_set, [item], 1).ids
        trace = llada.generate(model.params, ids, config=model.config, options=options, setup=RunSetup(policy=policy))
        nfe, s = int(trace.nfe), ids.shape[1] + GEN_LENGTH
        buckets = getattr(policy.bind(layout(ids.shape[1], GEN_LENGTH, BLOCK_LENGTH)), "buckets", ())
        blocks = GEN_LENGTH // BLOCK_LENGTH
        for step in range(nfe):
          if condition.cache == "dual" and not policy.enabled:
            kinds = {"full": 1.0} if step < blocks else {"dual_cache": 1.0}
          else:
            kinds = classify(policy.NAME, trace, step, s, ids.shape[1], model.config.n_layers, buckets)
          mix.update(kinds)
          if step:
            later.update(kinds)
        calls += nfe
    except PolicyError as error:
      results[condition] = {"refused": str(error)}
      continue
    tokens = GEN_LENGTH * len(todo)
    results[condition] = {"calls": calls, "tokens": tokens, "tokens_per_call": tokens / calls,
                          "mix": {kind: weight / calls for kind, weight in sorted(mix.items())},
                          "mix_after_first": {kind: weight / (calls - len(todo))
                                              for kind, weight in sorted(later.items())}}
  return results

