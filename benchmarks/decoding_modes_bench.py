r"""Decoding-modes benchmark: exact LLaDA decoding against Fast-dLLM's threshold decoding and KV caches, with
and without per-step attention statistics, in one run.

    python -m benchmarks.decoding_modes_bench                 # embedded tiny DLM, the 200-problem synthetic test split
    python -m benchmarks.decoding_modes_bench --checkpoint=random:llada-8b --n=2 --gen_length=256 \
        --block_length=32 --dtype=bfloat16 --attention_impl=fused   # LLaDA-8B shape, random weights (GPU)

--checkpoint is a converted directory or `tiny-dlm` (prompts: the synthetic test split in the training
layout, as `experiments.evaluate_synthetic`; scored by exact match, GSM8K strict `#### n`), or
`random:<preset>` (random weights of a `dlm_jax.config` preset, random prompts of --prompt_length tokens;
no accuracy — random weights are rarely confident, so the threshold rule commits about one token per
call and the run measures the cost of each mode's model calls).

For each mode of --modes (`name`, `name:τ`, or a decoding rule `name:knob=value`, e.g. `eb:gamma=0.01`,
`pc:prior=FILE`, with "+" between a rule's knobs because commas separate the modes: `eb:gamma=0.01+cache=dual`,
as lm-eval's policy model_arg; `dlm_jax.session.decoding_mode`) it decodes the --n prompts in
batches of --batch_size (default 1, as Fast-dLLM measures) with statistics off, then with per-head incoming
attention of every layer on (`StatsSpec(incoming_attention=True, per_head=True)`), and reports:

  accuracy      exact match over the problems (statistics never change the tokens);
  NFE per row   model calls each prompt decoded with (`Trace.row_nfe`), mean; calls per batch (`Trace.nfe`);
  tokens/call   generated positions holding a token at the end (mask ids excluded) per row NFE, over all
                prompts (the parallelism of a rule; 1 for one token per call);
  tokens/s      generated non-EOS tokens / wall time of the decoding loop (Fast-dLLM's count), each mode's
                program compiled beforehand by one warm-up call; "× exact": the ratio to exact decoding
                with the same statistics setting;
  ms per call   wall time / model calls;
  stats cost    time with statistics / time without − 1, per mode.

Timings: --repeats rounds over the batches, each batch decoded with statistics off and then on (so that
the load of a shared machine affects both alike); a setting's time is the sum over the batches of each
batch's minimum over the rounds. The CPU model (/proc/cpuinfo) and the JAX device are
printed and written with the results to --json_out. The targets are checked at the end: threshold +
dual cache at least 4× the tokens/s of exact decoding with accuracy within 2 points, statistics at most
15% per mode.
"""

from __future__ import annotations

import json
import os
import time

from absl import app, flags

from benchmarks.machine import cpu_model
from dlm_jax.sampling.run_setup import RunSetup

_CHECKPOINT = flags.DEFINE_string("checkpoint", "tiny-dlm", "Converted directory, tiny-dlm, or random:<preset> "
                                  "(e.g. random:llada-8b).")
_MODES = flags.DEFINE_list("modes", ["exact", "threshold:0.9", "threshold:0.7", "prefix_cache", "dual_cache",
                                     "threshold_dual_cache:0.9"],
                           "Decoding modes, comma-separated: name, name:value, or a decoding rule name:knob=value with "
                           "'+' between its knobs (eb:gamma=0.01+cache=dual).")
_N = flags.DEFINE_integer("n", 200, "Prompts (synthetic test problems, or random prompts), >= 1.")
_DATA_SEED = flags.DEFINE_integer("data_seed", 0, "Seed of the synthetic test split / random prompts.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 1, "Prompts per sampler call.")
_GEN_LENGTH = flags.DEFINE_integer("gen_length", None, "Generated positions (default: the checkpoint's training "
                                   "answer width, else 256).")
_BLOCK_LENGTH = flags.DEFINE_integer("block_length", None, "Block length (default: 8 for 32 positions, else 32).")
_STEPS = flags.DEFINE_integer("steps", None, "Steps of the quota modes (default: gen_length, one token per step).")
_PROMPT_LENGTH = flags.DEFINE_integer("prompt_length", 512, "random:<preset>: prompt tokens.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Weights and activations dtype.")
_IMPL = flags.DEFINE_enum("attention_impl", "chunked", ["chunked", "dense", "fused"], "dlm_jax attention path.")
_QUERY_CHUNK = flags.DEFINE_integer("query_chunk", 128, "Query block of the chunked attention.")
_REPEATS = flags.DEFINE_integer("repeats", 1, "Timed passes per (mode, statistics); the minimum is reported.")
_JSON_OUT = flags.DEFINE_string("json_out", "decoding_modes_bench.json", "Where to write the results.")
_FIGURE_OUT = flags.DEFINE_string("figure_out", None, "Optional PNG: accuracy, tokens per call and tokens/s per "
                                  "mode (statistics off).")

TARGET_SPEEDUP, TARGET_ACCURACY_POINTS, TARGET_STATS_COST = 4.0, 2.0, 0.15


def _workload(checkpoint: str, n: int, seed: int, dtype):
  """(config, params, problems or None, model or None, prompt ids [n, Lp], prompt mask [n, Lp] or None)."""
  import jax
  import numpy as np
  from dlm_jax.io import checkpoint as ckpt
  from dlm_jax import model as model_lib
  from dlm_jax.config import preset
  from dlm_jax.sampling import llada
  from experiments.common import checkpoints, items, prompts
  if checkpoint.startswith("random:"):
    config = preset(checkpoint.split(":", 1)[1])
    params = model_lib.init_params(config, jax.random.key(seed), dtype)
    specials = [i for i in (config.mask_token_id, config.eos_token_id, config.eot_token_id, config.pad_token_id,
                            config.bos_token_id) if i is not None]
    ordinary = np.setdiff1d(np.arange(config.vocab_size), specials)
    ids = np.random.default_rng(seed).choice(ordinary, size=(n, _PROMPT_LENGTH.value)).astype(np.int32)
    return config, params, None, None, ids, None
  model = checkpoints.prepare(checkpoint, "auto", "training")
  if model.decoder.generate is not llada.generate:  # the modes are timed on LLaDA's generate
    raise app.UsageError(f"--checkpoint={checkpoint}: expected a LLaDA-style diffusion model, got {model.sampler}")
  config, params = ckpt.load(model.directory, dtype=dtype)
  problems = items.load_items("synthetic", n, seed)
  batch = prompts.batch(prompts.encode(model, problems), problems, len(problems))
  return config, params, problems, model, batch.ids, batch.mask


def _lengths(model) -> tuple[int, int, int]:
  data = model.record.get("data", {}) if model is not None else {}
  gen = _GEN_LENGTH.value
  if gen is None:
    gen = int(data["seq_len"]) - int(data["prompt_len"]) if data.get("seq_len") else 256
  block = _BLOCK_LENGTH.value or (8 if gen == 32 else min(32, gen))
  return gen, block, _STEPS.value or gen


def _decode_batch(params, config, options, ids, mask, stats_spec, impl: dict):
  """Decodes one batch of prompts; returns (wall seconds, trace)."""
  import jax
  from dlm_jax.sampling import llada
  start = time.perf_counter()
  trace = jax.block_until_ready(llada.generate(params, ids, config=config, options=options, prompt_mask=mask,
                                               setup=RunSetup(stats_spec=stats_spec, **impl)))
  return time.perf_counter() - start, trace


def _accuracy(model, problems, generated) -> float | None:
  from dlm_jax.tasks import gsm8k
  from experiments.common import prompts
  if problems is None:
    return None
  texts = [prompts.completion(model, row)[1] for row in generated]
  return gsm8k.accuracy([gsm8k.Problem(p.question, p.target) for p in problems], texts)["strict_match"]


def measure(mode_spec: str, setup: dict) -> list[dict]:
  """One mode with statistics off and on: a warm-up (compiling) call of each, then --repeats rounds over the
  batches, each batch decoded with statistics off and then on, so that a change in the machine's load
  affects both settings alike. A setting's wall time is the sum over the batches of each batch's minimum
  over the rounds (a shared machine's load bursts inflate single calls, not the minimum). Returns the
  (off, on) results."""
  import numpy as np
  from dlm_jax.sampling import llada
  from dlm_jax.instrument.stats import NO_STATS, StatsSpec
  from dlm_jax.session import decoding_mode
  mode = decoding_mode.from_spec(mode_spec)
  gen, block, steps = setup["lengths"]
  options = llada.LLaDAOptions(gen_length=gen, steps=steps, block_length=block, **mode.option_fields("llada"))
  specs = (NO_STATS, StatsSpec(incoming_attention=True, per_head=True))
  ids, mask, bs = setup["ids"], setup["mask"], setup["batch_size"]
  args = (setup["params"], setup["config"], options)
  starts = range(0, ids.shape[0], bs)
  batches = [(ids[s:s + bs], None if mask is None else mask[s:s + bs]) for s in starts]
  for spec in specs:
    for rows in {len(b[0]) for b in batches}:  # every batch shape of the timed rounds
      _decode_batch(*args, *next(b for b in batches if len(b[0]) == rows), spec, setup["impl"])
  walls = np.full((len(specs), len(batches)), np.inf)
  traces = [[None] * len(batches) for _ in specs]
  for _ in range(setup["repeats"]):
    for j, (batch_ids, batch_mask) in enumerate(batches):
      for i, spec in enumerate(specs):
        wall, traces[i][j] = _decode_batch(*args, batch_ids, batch_mask, spec, setup["impl"])
        walls[i, j] = min(walls[i, j], wall)
  best = [float(x) for x in walls.sum(axis=1)]
  results = []
  for stats, wall, run in zip((False, True), best, traces):
    generated = np.concatenate([np.asarray(t.generated) for t in run])
    row_nfe = np.concatenate([np.asarray(t.row_nfe) for t in run])
    calls = sum(int(t.nfe) for t in run)
    eos = setup["config"].eos_token_id
    tokens = int((generated != eos).sum()) if eos is not None else int(generated.size)
    decoded = int((generated != setup["config"].mask_token_id).sum())
    results.append({"mode": mode_spec, "statistics": stats, "tokens_per_call": decoded / float(row_nfe.sum()),
                    "accuracy": _accuracy(setup["model"], setup["problems"], generated),
                    "mean_row_nfe": float(row_nfe.mean()), "calls": calls, "calls_per_batch": calls / len(run),
                    "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "ms_per_call": 1e3 * wall / calls})
  return results


def _table(results: list[dict]) -> list[str]:
  exact = {r["statistics"]: r for r in results if r["mode"] == "exact"}
  off = {r["mode"]: r for r in results if not r["statistics"]}
  width = max([26] + [len(_short(r["mode"])) for r in results])
  lines = [f"{'mode':<{width}} {'stats':>5} {'accuracy':>8} {'NFE/row':>7} {'tok/call':>8} {'calls/batch':>11} "
           f"{'tok/s':>9} {'x exact':>7} {'ms/call':>8} {'stats cost':>10}"]
  for r in results:
    ref = exact.get(r["statistics"])
    r["ratio_to_exact"] = r["tokens_per_s"] / ref["tokens_per_s"] if ref else None
    if r["statistics"] and r["mode"] in off:
      r["stats_cost"] = r["wall_s"] / off[r["mode"]]["wall_s"] - 1
    acc = "–" if r["accuracy"] is None else f"{100 * r['accuracy']:.1f}%"
    ratio = "–" if r["ratio_to_exact"] is None else f"{r['ratio_to_exact']:.2f}x"
    cost = f"{100 * r['stats_cost']:+.1f}%" if "stats_cost" in r else ""
    lines.append(f"{_short(r['mode']):<{width}} {'on' if r['statistics'] else 'off':>5} {acc:>8} "
                 f"{r['mean_row_nfe']:>7.2f} {r['tokens_per_call']:>8.2f} {r['calls_per_batch']:>11.2f} "
                 f"{r['tokens_per_s']:>9.1f} {ratio:>7} {r['ms_per_call']:>8.2f} "
                 f"{cost:>10}")
  return lines


def _short(spec: str) -> str:
  """A mode's name for tables: a rule's prior file path shortened to its file name."""
  name, _, rest = spec.partition(":")
  if name != "pc" or not rest:
    return spec
  return name + ":" + "+".join(os.path.basename(v) if k == "prior" else f"{k}={v}"
                               for k, _, v in (item.partition("=") for item in rest.replace(",", "+").split("+")))


def figure(results: list[dict], title: str, path: str) -> None:
  """Accuracy, tokens per call and tokens/s of each mode (statistics off) as three bar panels, written to path."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  off = [r for r in results if not r["statistics"]]
  names = [_short(r["mode"]) for r in off]
  fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
  panels = (("accuracy (%)", [100 * (r["accuracy"] or 0.0) for r in off]),
            ("tokens per model call", [r["tokens_per_call"] for r in off]),
            ("tokens/s (compilation excluded)", [r["tokens_per_s"] for r in off]))
  for ax, (label, values) in zip(axes, panels):
    ax.bar(range(len(names)), values, color="#4c72b0")
    ax.set_xticks(range(len(names)), names, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel(label)
  fig.suptitle(title)
  fig.tight_layout()
  tmp = f"{path}.tmp.png"
  fig.savefig(tmp, dpi=120)
  plt.close(fig)
  os.replace(tmp, path)


def targets(results: list[dict]) -> dict:
  """Whether threshold + dual cache reaches 4× exact tokens/s within 2 accuracy points, and statistics cost
  at most 15% in every mode."""
  off = {r["mode"]: r for r in results if not r["statistics"]}
  fast = next((r for m, r in off.items() if m.startswith("threshold_dual_cache")), None)
  out = {}
  if fast is not None and "exact" in off:
    exact = off["exact"]
    points = None if fast["accuracy"] is None else 100 * abs(fast["accuracy"] - exact["accuracy"])
    out["speedup"] = {"mode": fast["mode"], "ratio": fast["ratio_to_exact"], "accuracy_points": points,
                      "met": fast["ratio_to_exact"] >= TARGET_SPEEDUP and (points is None
                                                                          or points <= TARGET_ACCURACY_POINTS + 1e-9)}
  costs = {r["mode"]: r["stats_cost"] for r in results if "stats_cost" in r}
  out["statistics"] = {"cost": costs, "met": all(c <= TARGET_STATS_COST for c in costs.values())}
  return out


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  import jax
  import jax.numpy as jnp
  from dlm_jax.session import SessionError, decoding_mode
  if _N.value < 1 or _BATCH_SIZE.value < 1 or _REPEATS.value < 1:
    raise app.UsageError("--n, --batch_size and --repeats must be positive")
  try:
    for spec in _MODES.value:
      decoding_mode.from_spec(spec)
  except SessionError as e:
    raise app.UsageError(f"--modes: {e}") from None
  machine = {"cpu": cpu_model(), "jax_device": f"{jax.devices()[0].platform}: {jax.devices()[0].device_kind}",
             "jax_version": jax.__version__}
  print(f"CPU: {machine['cpu']}\nJAX device: {machine['jax_device']}")
  config, params, problems, model, ids, mask = _workload(_CHECKPOINT.value, _N.value, _DATA_SEED.value,
                                                         jnp.dtype(_DTYPE.value))
  setup = {"config": config, "params": params, "problems": problems, "model": model, "ids": ids, "mask": mask,
           "lengths": _lengths(model), "batch_size": _BATCH_SIZE.value, "repeats": _REPEATS.value,
           "impl": {"attention_impl": _IMPL.value, "query_chunk": _QUERY_CHUNK.value}}
  gen, block, steps = setup["lengths"]
  print(f"{_CHECKPOINT.value}: {ids.shape[0]} prompts of {ids.shape[1]} tokens, {gen} generated, blocks of {block}, "
        f"{steps} steps (quota modes), batch {_BATCH_SIZE.value}, {_DTYPE.value}, {_IMPL.value} attention")
  results = []
  for spec in _MODES.value:
    results += measure(spec, setup)
    print(f"  {spec}: {results[-2]['wall_s']:.2f}s with statistics off, {results[-1]['wall_s']:.2f}s on", flush=True)
  lines = _table(results)
  print("\n".join(lines))
  checked = targets(results)
  if "speedup" in checked:
    s = checked["speedup"]
    points = "–" if s["accuracy_points"] is None else f"{s['accuracy_points']:.1f} points"
    print(f"target {s['mode']} >= {TARGET_SPEEDUP:g}x exact tokens/s within {TARGET_ACCURACY_POINTS:g} accuracy "
          f"points: {s['ratio']:.2f}x, {points} -> {'met' if s['met'] else 'NOT met'}")
  worst = max(checked["statistics"]["cost"].items(), key=lambda kv: kv[1])
  print(f"target statistics <= {100 * TARGET_STATS_COST:g}% per mode: worst {worst[0]} {100 * worst[1]:+.1f}% -> "
        f"{'met' if checked['statistics']['met'] else 'NOT met'}")
  report = {"machine": machine, "flags": {"checkpoint": _CHECKPOINT.value, "n": int(ids.shape[0]),
                                          "prompt_length": int(ids.shape[1]), "gen_length": gen, "block_length": block,
                                          "steps": steps, "batch_size": _BATCH_SIZE.value, "dtype": _DTYPE.value,
                                          "attention_impl": _IMPL.value, "repeats": _REPEATS.value},
            "results": results, "table": lines, "targets": checked}
  tmp = f"{_JSON_OUT.value}.tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(report, f, indent=2)
  os.replace(tmp, _JSON_OUT.value)
  print(f"results written to {_JSON_OUT.value}")
  if _FIGURE_OUT.value:
    figure(results, f"{_CHECKPOINT.value}: {ids.shape[0]} prompts, {gen} generated, blocks of {block}, {steps} steps "
           "(quota modes)", _FIGURE_OUT.value)
    print(f"figure written to {_FIGURE_OUT.value}")


if __name__ == "__main__":
  app.run(main)
