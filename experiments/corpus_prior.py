"""Writes PC-Sampler's corpus frequency prior for a checkpoint's tokenizer from the synthetic task's training
split (questions and answers), the prior `--decoding=pc --pc_prior=FILE` reads.

  python -m experiments.corpus_prior --checkpoint=tiny-dlm --output=tiny-dlm-prior.json

The file (`dlm_jax.sampling.corpus_prior`) records the tokenizer's vocabulary digest and a checksum, so a prior
of another tokenizer, or a torn file, is refused by the samplers. The original PC-Sampler counts a general
corpus for LLaDA's tokenizer; for the embedded checkpoints, whose vocabulary is the synthetic task's, the
task's own training text is the corpus. Prints one JSON line (path, tokens counted, distinct ids).
"""

from __future__ import annotations

import json
import os

from absl import flags

from dlm_jax.sampling import corpus_prior
from dlm_jax.tasks import synthetic
from experiments.common import checkpoints, cli, run_dir

_CHECKPOINT = flags.DEFINE_string("checkpoint", "tiny-dlm", "Converted checkpoint directory, or tiny-dlm, tiny-arm, "
                                  "tiny-moe-dlm, tiny-uniform-dlm (its tokenizer is the prior's).")
_OUTPUT = flags.DEFINE_string("output", None, "The prior file to write (JSON).")
_N = flags.DEFINE_integer("n", 2000, "Training problems counted (>= 1).")
_DATA_SEED = flags.DEFINE_integer("data_seed", 0, "Seed of the synthetic generator.")


def main(argv) -> None:
  del argv
  if not _OUTPUT.value:
    raise cli.UsageError("--output is required: the prior file to write")
  if _N.value < 1:
    raise cli.UsageError(f"--n={_N.value}: expected at least 1 problem")
  run_dir.check_output_file(_OUTPUT.value, "output")
  model = checkpoints.prepare(_CHECKPOINT.value, "auto", "plain")
  tokenizer = model.tokenizer
  texts = [text for p in synthetic.make_split("train", _N.value, _DATA_SEED.value) for text in (p.question, p.answer)]
  document = corpus_prior.count((tokenizer.encode(text) for text in texts),
                                tokenizer.backend.get_vocab(with_added_tokens=True), model.config.vocab_size)
  corpus_prior.save(document, _OUTPUT.value)
  print(json.dumps({"output": os.path.abspath(_OUTPUT.value), "num_tokens": document["num_tokens"],
                    "distinct_ids": len(document["counts"])}))


if __name__ == "__main__":
  cli.run(main)
