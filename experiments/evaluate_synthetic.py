"""Exact match of a converted checkpoint on the synthetic arithmetic test split.

  python -m experiments.evaluate_synthetic --checkpoint=tiny-dlm
  python -m experiments.evaluate_synthetic --checkpoint=tiny-arm --output=tiny-arm.jsonl

Prompts use the checkpoint's training layout (`experiments.common.prompts`: `[PAD … BOS question]` of the
training prompt width). Diffusion models are decoded with LLaDA's `generate` (low-confidence remasking,
temperature 0) with steps = gen_length and one block by default — pure diffusion, unlike the official
block_length 128 of `experiments.generate`, because the answers are 32 tokens; DiffusionGemma-style
models with their sampler over one canvas of gen_length (at most --steps decoder steps, default 48; it
samples, with one PRNG key per problem); causal models greedily with the KV-cache decoder. Completions are scored with the GSM8K strict (`#### n`) and flexible (last
number) extractors. Progress lines go to the log; the summary is one JSON line on stdout; --output writes
one JSON line per item (atomically, at the end).
"""

from __future__ import annotations

import dataclasses
import json
import time

from absl import flags, logging

from dlm_jax.runtime import distributed
from dlm_jax.tasks import gsm8k
from dlm_jax.session import decode_settings, size_limits
from experiments.common import (atomic_files, checkpoints, cli, decoding, devices, flag_checks, item_batches, items,
                                numerics, numerics_flags, progress, prompts, run_dir, runtime_flags)
from experiments.common.numerics import Numerics

_CHECKPOINT = flags.DEFINE_string("checkpoint", "tiny-dlm", "Converted checkpoint directory, or tiny-dlm, tiny-arm, tiny-moe-dlm, "
                                  "tiny-uniform-dlm.")
_N = flags.DEFINE_integer("n", 200, "Test problems (>= 1).")
_DATA_SEED = flags.DEFINE_integer("data_seed", 0, "Seed of the synthetic generator.")
_GEN_LENGTH = flags.DEFINE_integer("gen_length", 32, "Generated positions.")
_STEPS = flags.DEFINE_integer("steps", None, "Diffusion steps (default: gen_length; DiffusionGemma: at most 48 "
                              "decoder steps).")
_BLOCK_LENGTH = flags.DEFINE_integer("block_length", None, "Diffusion block length (default: gen_length, pure "
                                     "diffusion; experiments.generate defaults to 128).")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 100, "Prompts per sampler call (results do not depend on it).")
_OUTPUT = flags.DEFINE_string("output", None, "Optional JSONL of per-item results.")


@dataclasses.dataclass(frozen=True)
class Settings:
  """One evaluation: checkpoint directory, number of problems, their seed, decoding and numerics."""

  checkpoint: str
  n: int
  data_seed: int
  batch_size: int
  decode: decode_settings.DecodeSettings
  numerics: Numerics

  def __post_init__(self):
    if self.n < 1:
      raise cli.UserError(f"--n={self.n}: expected a positive number of problems")
    flag_checks.positive(batch_size=self.batch_size)
    size_limits.check(n=self.n, batch_size=self.batch_size)


def main(argv):
  del argv
  runtime_settings = runtime_flags.from_flags()
  if _OUTPUT.value:
    run_dir.check_output_file(_OUTPUT.value, "output")
  model = checkpoints.prepare(_CHECKPOINT.value, "auto", "training")
  if model.sampler not in ("llada", "ar", "diffusion_gemma"):
    raise cli.UserError(f"{model.label}: expected a LLaDA-style diffusion model, a DiffusionGemma-style model or a "
                        f"causal model, got a {model.sampler} model")
  gen_length = _GEN_LENGTH.value
  decode = decode_settings.DecodeSettings(gen_length=gen_length, steps=_STEPS.value,
                                   block_length=_BLOCK_LENGTH.value if _BLOCK_LENGTH.value is not None else gen_length)
  runtime = devices.init_runtime(runtime_settings)
  settings = Settings(model.directory, _N.value, _DATA_SEED.value, _BATCH_SIZE.value, decode,
                      numerics_flags.from_flags(runtime_settings))
  values = decode_settings.model_settings(decode, model)
  problems = items.load_items("synthetic", settings.n, settings.data_seed)
  prompt_set = prompts.encode(model, problems)
  model = checkpoints.load_weights(model, runtime, settings.numerics)
  start = time.time()
  completions = {}
  meter = progress.Progress(f"{model.label} problems", len(problems))
  for batch in item_batches.batches(problems, prompt_set, settings.batch_size, decode.seed, runtime,
                                    lambda item: False):
    trace = decoding.generate(model, values, batch.prompts, runtime, settings.numerics, key=batch.key)
    generated = distributed.to_host(trace.generated)
    for row, item in enumerate(batch.items):
      completions[item.id] = prompts.completion(model, generated[row])[1]
    meter.update(len(batch.items))
  problem_list = [gsm8k.Problem(p.question, p.target) for p in problems]
  texts = [completions[p.id] for p in problems]
  scores = gsm8k.accuracy(problem_list, texts)
  scores["wall_s"] = round(time.time() - start, 1)
  if _OUTPUT.value:
    lines = [json.dumps({"question": p.question, "completion": c, **s})
             for p, c, s in zip(problem_list, texts, gsm8k.iter_scores(problem_list, texts))]
    atomic_files.write_text(_OUTPUT.value, "".join(line + "\n" for line in lines))
  for problem, completion in list(zip(problem_list, texts))[:3]:
    logging.info("Q: %s\nA: %s\ngot: %s", problem.question, problem.answer, completion)
  print(json.dumps({"checkpoint": progress.display_path(model.directory), "settings": values, **scores}))


if __name__ == "__main__":
  cli.run(main)
