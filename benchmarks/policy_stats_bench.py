r"""What recording statistics costs a compute policy's run, and a decoding rule's: every policy's and every rule's
compiled LLaDA sampler run with statistics off and with the instrument's per-head incoming attention (the sink
statistics) on, in one process, interleaved.

    python -m benchmarks.policy_stats_bench                       # width 512, 4 layers, prompt 64 + 128
    python -m benchmarks.policy_stats_bench --policies=none,sparse_dllm --rules=eb,klass:kl_threshold=0.02+kl_history_length=3 --rounds=5

Model: a random LLaDA-shaped config (--width, --layers, --heads, MLP 3 × width, --vocab_size), float32, batch 1,
exact decoding (one token per step) of --gen_length tokens in blocks of --block_length, temperature 0. Each
(policy, statistics) pair is compiled once and warmed up; then --rounds rounds run every pair once each, in the
same order, so that a change of the machine's load reaches every pair alike; the median over the rounds is
reported, with the step time (run time / steps) and the overhead of statistics over the same policy without
them. Issue 36's goal: statistics recorded alongside a policy cost <= 10% extra step time.

--rules (issue 34's goal, the same <= 10%): each decoding rule of `dlm_jax.sampling.decoding_rules`, given as
`name` or `name:knob=value+knob=value` (its knobs and `cache=prefix|dual`, `+` between them, as the modes
benchmark's --modes), runs without a policy; its step is one model call (run time / the run's NFE: a rule commits a varying number of tokens per call, and statistics
do not change which). PC-Sampler's corpus prior, unless `prior=FILE` is given, is counted from 4,096 random
tokens of the benchmark's vocabulary (`dlm_jax.sampling.corpus_prior.count`).

The CPU model and the load average before and after are printed; results go to --json_out (temp + rename).
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

from absl import app, flags

from benchmarks.machine import cpu_model

NAME = "benchmarks.policy_stats_bench"

_POLICIES = flags.DEFINE_list("policies", ["none", "dkv_cache", "sparse_dllm", "sparsed", "dllm_cache",
                                           "elastic_cache:window_length=32", "d2cache"],
                              "Policy texts (parse_policy) to measure (Elastic-Cache's window: the block length).")
_RULES = flags.DEFINE_list("rules", ["eb", "klass", "wino", "pc", "certainty_prior"],
                           "Decoding rules to measure, `name` or `name:knob=value+knob=value` (none: --rules=).")
_WIDTH = flags.DEFINE_integer("width", 512, "Model width D.")
_LAYERS = flags.DEFINE_integer("layers", 4, "Layers L.")
_HEADS = flags.DEFINE_integer("heads", 8, "Attention heads (MHA).")
_VOCAB = flags.DEFINE_integer("vocab_size", 16384, "Vocabulary V.")
_PROMPT = flags.DEFINE_integer("prompt_length", 64, "Prompt tokens.")
_GEN = flags.DEFINE_integer("gen_length", 128, "Generated tokens (one per step).")
_BLOCK = flags.DEFINE_integer("block_length", 32, "Semi-autoregressive block length.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Timed rounds; the median counts.")
_JSON_OUT = flags.DEFINE_string("json_out", "policy_stats_bench.json", "Where to write the results.")


def fail(message: str) -> None:
  """One line on stderr, exit code 1."""
  sys.exit(f"{NAME}: error: {message}")


def checked_policies() -> dict:
  """{text: policy} of --policies, every flag checked (one line per problem) before any model work."""
  from dlm_jax.policy.registry import parse_policy  # pylint: disable=import-outside-toplevel
  for name, value in (("width", _WIDTH.value), ("layers", _LAYERS.value), ("heads", _HEADS.value),
                      ("vocab_size", _VOCAB.value), ("prompt_length", _PROMPT.value), ("gen_length", _GEN.value),
                      ("block_length", _BLOCK.value), ("rounds", _ROUNDS.value)):
    if value < 1:
      fail(f"--{name}={value}: expected a positive integer")
  if _WIDTH.value % _HEADS.value:
    fail(f"--heads={_HEADS.value}: expected a divisor of --width={_WIDTH.value}")
  if _GEN.value % _BLOCK.value:
    fail(f"--block_length={_BLOCK.value}: expected a divisor of --gen_length={_GEN.value}")
  if not _POLICIES.value and not _RULES.value:
    fail("--policies, --rules: expected at least one policy text or decoding rule")
  policies = {}
  for text in _POLICIES.value:
    try:
      policies[text] = parse_policy(text)
    except ValueError as error:
      fail(f"--policies: {text}: {error}")
  return policies


def checked_rules() -> dict:
  """{spec: (rule, its KV cache)} of --rules (`dlm_jax.session.decoding_mode.from_spec`), each checked in one line
  before any model work; pc's prior, unless a file is named, counted from random tokens of the benchmark's
  vocabulary and written to a temporary file (removed at exit)."""
  import numpy as np  # pylint: disable=import-outside-toplevel

  from dlm_jax.sampling import corpus_prior, decoding_rules  # pylint: disable=import-outside-toplevel
  from dlm_jax.session import decoding_mode  # pylint: disable=import-outside-toplevel
  rules = {}
  for spec in _RULES.value:
    name, sep, _ = spec.partition(":")
    if name not in decoding_rules.RULE_NAMES:
      fail(f"--rules: {spec}: expected a decoding rule, one of {', '.join(decoding_rules.RULE_NAMES)}")
    parsed = spec
    if name == "pc" and "prior=" not in spec:
      directory = tempfile.mkdtemp(prefix="policy_stats_bench_prior_")
      atexit.register(shutil.rmtree, directory, ignore_errors=True)
      path = os.path.join(directory, "prior.json")
      vocab = {str(i): i for i in range(_VOCAB.value)}
      tokens = np.random.default_rng(2).integers(0, _VOCAB.value, size=4096).tolist()
      corpus_prior.save(corpus_prior.count([tokens], vocab, _VOCAB.value), path)
      parsed = f"{spec}+prior={path}" if sep else f"pc:prior={path}"
    try:
      mode = decoding_mode.from_spec(parsed)
      rules[spec] = (mode.decoding_rule(), mode.rule_cache)
    except ValueError as error:
      fail(f"--rules: {spec}: {error}")
  return rules


def main(argv: list[str]) -> None:
  del argv
  policies = checked_policies()
  rules = checked_rules()
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  from dlm_jax.config import ModelConfig  # pylint: disable=import-outside-toplevel
  from dlm_jax.instrument.stats import NO_STATS, StatsSpec  # pylint: disable=import-outside-toplevel
  from dlm_jax.model import init_params  # pylint: disable=import-outside-toplevel
  from dlm_jax.policy.base import PolicyError  # pylint: disable=import-outside-toplevel
  from dlm_jax.policy.registry import parse_policy  # pylint: disable=import-outside-toplevel
  from dlm_jax.sampling import llada  # pylint: disable=import-outside-toplevel
  from dlm_jax.sampling.run_setup import RunSetup  # pylint: disable=import-outside-toplevel

  width, vocab = _WIDTH.value, _VOCAB.value
  config = ModelConfig(name=f"bench-{width}", d_model=width, n_layers=_LAYERS.value, n_heads=_HEADS.value,
                       n_kv_heads=_HEADS.value, head_dim=width // _HEADS.value, mlp_hidden=3 * width,
                       vocab_size=vocab, rope_theta=500000.0, rope_fp32=True, mask_token_id=vocab - 1,
                       eos_token_id=1, eot_token_id=2, bos_token_id=0, pad_token_id=1)
  params = init_params(config, jax.random.key(0))
  prompt = np.random.default_rng(1).integers(3, vocab - 1, size=(1, _PROMPT.value))
  options = llada.LLaDAOptions(gen_length=_GEN.value, steps=_GEN.value, block_length=_BLOCK.value)
  specs = {"off": NO_STATS, "stats": StatsSpec(incoming_attention=True)}
  print(f"CPU: {cpu_model()}; device: {jax.devices()[0].platform}; width {width}, {_LAYERS.value} layers, vocab "
        f"{vocab}; prompt {_PROMPT.value} + {_GEN.value} in blocks of {_BLOCK.value}; load average "
        f"{os.getloadavg()[0]:.1f}", flush=True)
  results = {"cpu": cpu_model(), "device": jax.devices()[0].platform, "width": width, "layers": _LAYERS.value,
             "heads": _HEADS.value, "vocab_size": vocab, "prompt_length": _PROMPT.value, "gen_length": _GEN.value,
             "block_length": _BLOCK.value, "rounds": _ROUNDS.value, "load_average_start": os.getloadavg()[0],
             "policies": {}, "rules": {}}
  configurations = [("policies", text, options, policy) for text, policy in policies.items()]
  configurations += [("rules", spec, dataclasses.replace(options, rule=rule, cache=cache), parse_policy("none"))
                     for spec, (rule, cache) in rules.items()]

  runs, nfe = {}, {}
  for group, text, run_options, policy in configurations:
    for condition, spec in specs.items():
      def run(run_options=run_options, policy=policy, spec=spec):
        return jax.block_until_ready(llada.generate(params, prompt, config=config, options=run_options,
                                                    setup=RunSetup(stats_spec=spec, policy=policy)))
      try:
        begin = time.perf_counter()
        trace = run()
      except PolicyError as error:
        results[group][text] = {"refused": str(error)}
        print(f"  {text:28s} refused: {error}", flush=True)
        break
      print(f"  {text:28s} {condition:5s} compiled and warmed up in {time.perf_counter() - begin:.1f} s", flush=True)
      runs[(group, text, condition)] = run
      nfe[(group, text, condition)] = float(np.mean(np.asarray(trace.nfe)))
  seconds = {key: [] for key in runs}
  for _ in range(_ROUNDS.value):
    for key, run in runs.items():
      begin = time.perf_counter()
      run()
      seconds[key].append(time.perf_counter() - begin)
  for group, text, _, _ in configurations:
    if (group, text, "stats") not in runs:
      continue
    calls = {c: nfe[(group, text, c)] for c in specs}
    if calls["off"] != calls["stats"]:
      fail(f"{text}: {calls['off']} model calls without statistics, {calls['stats']} with; statistics must not "
           "change a run")
    ms = {c: statistics.median(seconds[(group, text, c)]) * 1e3 / calls[c] for c in specs}
    overhead = ms["stats"] / ms["off"] - 1
    results[group][text] = {"ms_per_step_off": ms["off"], "ms_per_step_stats": ms["stats"],
                            "stats_overhead": overhead, "model_calls": calls["off"],
                            "runs_s": {c: seconds[(group, text, c)] for c in specs}}
    print(f"  {text:28s} {ms['off']:8.2f} ms/step without statistics, {ms['stats']:8.2f} with: "
          f"{overhead:+.1%} (goal <= +10%; {calls['off']:g} model calls)", flush=True)
  results["load_average_end"] = os.getloadavg()[0]
  with open(_JSON_OUT.value + ".tmp", "w", encoding="utf-8") as f:
    json.dump(results, f, indent=1)
  os.replace(_JSON_OUT.value + ".tmp", _JSON_OUT.value)
  print(f"load average at the end {results['load_average_end']:.1f}; wrote {_JSON_OUT.value}")


if __name__ == "__main__":
  app.run(main)
