"""Exact match of a converted checkpoint on the synthetic arithmetic test split.

  python -m experiments.evaluate_synthetic --checkpoint=dlm_jax/default_models/tiny-dlm
  python -m experiments.evaluate_synthetic --checkpoint=dlm_jax/default_models/tiny-arm

Diffusion models are decoded with LLaDA's `generate` (low-confidence remasking, temperature 0; steps =
gen_length and one block by default); causal models greedily with the KV-cache decoder; prompts use the
training layout (see `dlm_jax.tasks.evaluation`). Completions are scored with the GSM8K strict (`#### n`)
and flexible (last number) extractors. Prints one JSON line; --output writes one JSON line per item.
"""

from __future__ import annotations

import json
import time

from absl import app, flags, logging

from dlm_jax import default_models
from dlm_jax.tasks import evaluation, gsm8k, synthetic

FLAGS = flags.FLAGS
flags.DEFINE_string("checkpoint", None, "Converted checkpoint directory; default: the embedded tiny-dlm.")
flags.DEFINE_integer("n", 200, "Test problems.")
flags.DEFINE_integer("data_seed", 0, "Seed of the synthetic generator.")
flags.DEFINE_integer("prompt_len", None, "Prompt width (default: the checkpoint's training.json, else 36).")
flags.DEFINE_integer("gen_length", 32, "Generated positions.")
flags.DEFINE_integer("steps", None, "Diffusion steps (default gen_length).")
flags.DEFINE_integer("block_length", None, "Diffusion block length (default gen_length: pure diffusion).")
flags.DEFINE_integer("batch_size", 100, "Prompts per sampler call.")
flags.DEFINE_string("output", None, "Optional JSONL of per-item results.")


def main(argv):
  del argv
  directory = FLAGS.checkpoint or default_models.path("tiny-dlm")
  problems = synthetic.make_split("test", FLAGS.n, FLAGS.data_seed)
  start = time.time()
  completions = evaluation.complete(directory, [p.question for p in problems], prompt_len=FLAGS.prompt_len,
                                    gen_length=FLAGS.gen_length, steps=FLAGS.steps, block_length=FLAGS.block_length,
                                    batch_size=FLAGS.batch_size)
  scores = gsm8k.accuracy(problems, completions)
  scores["wall_s"] = round(time.time() - start, 1)
  if FLAGS.output:
    with open(FLAGS.output, "w", encoding="utf-8") as f:
      for problem, completion, item in zip(problems, completions, gsm8k.iter_scores(problems, completions)):
        f.write(json.dumps({"question": problem.question, "completion": completion, **item}) + "\n")
  for problem, completion in list(zip(problems, completions))[:3]:
    logging.info("Q: %s\nA: %s\ngot: %s", problem.question, problem.answer, completion)
  print(json.dumps({"checkpoint": directory, **scores}))


if __name__ == "__main__":
  app.run(main)
