r"""Monte-Carlo likelihood speed (dlm_jax's batched program against the PyTorch way) and estimator variance.

  python -m benchmarks.lm_eval_likelihood_bench [--requests=16 --mc_num=32 --seeds=16 --json_out=FILE]

Speed: `--requests` (context, continuation) requests (context 40 tokens, continuation 12; random ids) scored
with LLaDA's stratified estimator at mc_num draws (strata of mc_num, as dllm's eval.sh: mc_num = batch = 32)
on two models: the embedded tiny-dlm and a wider random LLaDA-shaped model (--width, 4 layers, vocab 2048).
dlm_jax: `likelihood_batch.mc_log_likelihoods` (--pairs pairs per compiled call; compile time reported
apart). The PyTorch way, written here as LLaDA's `get_log_likelihood` / `eval_llada.py` do it: one request
at a time, mc_num / batch minibatches of `batch` noisy copies, each a full-logits forward of
`transformers`' Llama (bidirectional through an all-visible 4-D mask, `benchmarks.torch_way.build_model`)
followed by the stratified forward process (torch.linspace counts, a random permutation per row) and
Σ CE / (n/T) on the host side in eager torch. Throughput = requests × mc_num / seconds (draws/s), both in
float32 on this CPU, each best of --repeats after a warm-up, the two ways timed in turn (jax, torch, jax,
...) so that both see the same changes of load; the ratio is measured within one run. The load average
is printed at the start and the end: on a shared machine, read the figures with it.

Variance: the spread over --seeds seeds of the estimate of each of 8 requests at equal draws (mc_num),
averaged over the requests: LLaDA's stratified draws (strata of mc_num) against plain sampling (strata of
1: k uniform for every draw) on tiny-dlm scoring the worked answers of the local synthetic task
(experiments/lm_eval/tasks/synthetic_test.jsonl), and Dream's antithetic t (strata of mc_num) against plain
t on a random shifted model (`tiny-dream` preset, random ids; tiny-dlm is not a shifted model).

The XLA CPU options are `dlm_jax.runtime.xla_cpu`'s `auto` set, as the experiment binaries use.
"""

from __future__ import annotations

import json
import os
import time


import numpy as np
from absl import app, flags

from benchmarks.machine import cpu_model

_REQUESTS = flags.DEFINE_integer("requests", 16, "Requests scored in the speed test.")
_MC_NUM = flags.DEFINE_integer("mc_num", 32, "Draws per request.")
_PAIRS = flags.DEFINE_integer("pairs", 128, "dlm_jax: (request, draw) pairs per compiled call.")
_WIDTH = flags.DEFINE_integer("width", 512, "d_model of the wider random model.")
_SEEDS = flags.DEFINE_integer("seeds", 64, "Seeds per request in the variance test.")
_REPEATS = flags.DEFINE_integer("repeats", 2, "Timed repetitions (best kept).")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Optional JSON file of the figures.")

CONTEXT, CONTINUATION = 40, 12


def _models():
  """[(name, config, params)]: the embedded tiny-dlm and the wider random model."""
  import jax
  from dlm_jax import default_models, model
  from dlm_jax.io import checkpoint
  from dlm_jax.config import ModelConfig
  config, params = checkpoint.load(default_models.path("tiny-dlm"), dtype=np.float32)
  width = _WIDTH.value
  wide = ModelConfig(name=f"bench-{width}", d_model=width, n_layers=4, n_heads=8, n_kv_heads=8, head_dim=width // 8,
                     mlp_hidden=3 * width, vocab_size=2048, rope_theta=500000.0, rope_fp32=True, mask_token_id=2047,
                     eos_token_id=1, eot_token_id=2, bos_token_id=0, pad_token_id=1)
  return [("tiny-dlm", config, params), (wide.name, wide, model.init_params(wide, jax.random.key(0)))]


def _requests(config, count: int, seed: int = 1):
  rng = np.random.default_rng(seed)
  high = config.mask_token_id if config.mask_token_id == config.vocab_size - 1 else config.vocab_size
  return [(rng.integers(4, high, CONTEXT).tolist(), rng.integers(4, high, CONTINUATION).tolist())
          for _ in range(count)]


def _timed(fn) -> float:
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start


def _best_interleaved(fns, repeats: int) -> list[float]:
  """The best of `repeats` wall times of each function, run in turn (a, b, a, b, ...) so that a change of
  the machine's load during the run reaches both."""
  times = [[] for _ in fns]
  for _ in range(repeats):
    for fn, kept in zip(fns, times):
      kept.append(_timed(fn))
  return [min(kept) for kept in times]


def torch_llada_log_likelihood(model, prompt, answer, *, mc_num: int, batch: int, mask_id: int, generator):
  """LLaDA's estimator the PyTorch way (module docstring): prompt [Lp], answer [T] long tensors."""
  import torch
  seq = torch.cat([prompt, answer])[None, :].repeat(batch, 1)
  t, lp = answer.numel(), prompt.numel()
  visible = torch.zeros(batch, 1, seq.shape[1], seq.shape[1])
  losses = []
  with torch.no_grad():
    for _ in range(mc_num // batch):
      k = torch.randint(1, t + 1, (), generator=generator)
      counts = torch.round(torch.linspace(float(k), k + (batch - 1) * (t / batch), steps=batch)).long()
      counts = ((counts - 1) % t) + 1
      is_mask = torch.zeros(batch, t, dtype=torch.bool)
      for row in range(batch):
        is_mask[row, torch.randperm(t, generator=generator)[:counts[row]]] = True
      noisy = seq.clone()
      noisy[:, lp:][is_mask] = mask_id
      logits = model(input_ids=noisy, attention_mask=visible).logits
      mask_index = noisy == mask_id
      ratio = (counts.float() / t)[:, None].repeat(1, seq.shape[1])[mask_index]
      ce = torch.nn.functional.cross_entropy(logits[mask_index], seq[mask_index], reduction="none") / ratio
      losses.append(ce.sum().item() / batch)
  return -sum(losses) / len(losses)


def speed(name, config, params) -> dict:
  """Draws per second of both ways on one model."""
  import jax
  import torch
  from benchmarks import torch_way
  from dlm_jax.analysis import likelihood_batch as lb
  requests = _requests(config, _REQUESTS.value)
  mc = _MC_NUM.value
  settings = lb.MCSettings("llada", mc_num=mc, group=mc)
  run = lambda: lb.mc_log_likelihoods(params, requests, config=config, settings=settings, batch_size=_PAIRS.value)
  first = _timed(run)
  model = torch_way.build_model(jax.device_get(params), config, "sdpa")
  generator = torch.Generator().manual_seed(0)
  tensors = [(torch.tensor(c), torch.tensor(a)) for c, a in requests]
  torch_run = lambda: [torch_llada_log_likelihood(model, c, a, mc_num=mc, batch=mc, mask_id=config.mask_token_id,
                                                  generator=generator) for c, a in tensors]
  torch_llada_log_likelihood(model, *tensors[0], mc_num=mc, batch=mc, mask_id=config.mask_token_id,
                             generator=generator)
  jax_s, torch_s = _best_interleaved([run, torch_run], _REPEATS.value)
  draws = len(requests) * mc
  return {"model": name, "d_model": config.d_model, "requests": len(requests), "mc_num": mc,
          "jax_compile_s": max(first - jax_s, 0.0), "jax_s": jax_s, "torch_s": torch_s,
          "jax_draws_per_s": draws / jax_s, "torch_draws_per_s": draws / torch_s, "speedup": torch_s / jax_s}


def task_requests(count: int):
  """(BOS + question, worked answer) ids of the first `count` local synthetic items, tiny-dlm's tokenizer."""
  from dlm_jax import default_models
  from dlm_jax.io.tokenizer import Tokenizer
  from experiments.lm_eval.tasks import utils
  tokenizer = Tokenizer.from_dir(default_models.path("tiny-dlm"))
  with open(utils.DATA, encoding="utf-8") as f:
    rows = [json.loads(line) for line in f][:count]
  return [([1] + tokenizer.encode(r["question"]), tokenizer.encode(r["answer"])) for r in rows]


def variance(name, config, params, estimator: str, requests) -> dict:
  """Mean over the requests of the variance over seeds: stratified / antithetic against plain draws."""
  from dlm_jax.analysis import likelihood_batch as lb
  mc = _MC_NUM.value
  spread = {}
  for label, group in (("structured", mc), ("plain", 1)):
    settings = lb.MCSettings(estimator, mc_num=mc, group=group)
    estimates = np.stack([lb.mc_log_likelihoods(params, requests, config=config, settings=settings, seed=seed,
                                                batch_size=_PAIRS.value) for seed in range(_SEEDS.value)])
    spread[label] = float(np.mean(estimates.var(axis=0, ddof=1)))
  return {"model": name, "estimator": estimator, "mc_num": mc, "seeds": _SEEDS.value,
          "variance_structured": spread["structured"], "variance_plain": spread["plain"],
          "variance_reduction": spread["plain"] / spread["structured"]}


def main(argv):
  del argv
  from dlm_jax.runtime import xla_cpu
  xla_cpu.apply("auto")
  import jax
  from dlm_jax import model
  from dlm_jax.config import preset
  jax.config.update("jax_default_matmul_precision", "highest")
  models = _models()
  results = {"cpu": cpu_model(), "load_average": os.getloadavg(), "speed": [speed(*m) for m in models],
             "load_average_after_speed": os.getloadavg()}
  dream = preset("tiny-dream")
  results["variance"] = [
      variance(*models[0], "llada", task_requests(8)),
      variance("tiny-dream (random)", dream, model.init_params(dream, jax.random.key(3)), "dream",
               _requests(dream, 8, seed=2))]
  print(f"CPU: {results['cpu']}, load average at the start {results['load_average'][0]:.1f}, after the speed "
        f"test {results['load_average_after_speed'][0]:.1f}")
  print("| model | d_model | requests × mc_num | dlm_jax draws/s | torch draws/s | speedup | dlm_jax compile s |")
  print("|---|---|---|---|---|---|---|")
  for r in results["speed"]:
    print(f"| {r['model']} | {r['d_model']} | {r['requests']} × {r['mc_num']} | {r['jax_draws_per_s']:.0f} | "
          f"{r['torch_draws_per_s']:.0f} | {r['speedup']:.2f}x | {r['jax_compile_s']:.1f} |")
  print("\n| model | estimator | draws | variance (structured) | variance (plain) | reduction |")
  print("|---|---|---|---|---|---|")
  for r in results["variance"]:
    print(f"| {r['model']} | {r['estimator']} | {r['mc_num']} | {r['variance_structured']:.4g} | "
          f"{r['variance_plain']:.4g} | {r['variance_reduction']:.2f}x |")
  if _JSON_OUT.value:
    from experiments.common import atomic_files
    atomic_files.write_text(_JSON_OUT.value, json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
  app.run(main)
