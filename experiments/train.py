"""Trains a model with masked diffusion (pretrain / SFT), next-token prediction, or the extra sink token.

Examples (the embedded default models; see BUILD.md for the exact commands and timings):

  python -m experiments.train --preset=tiny-llada --override=d_model=128 ... --objective=sft \
      --data=synthetic --steps=3000 --run_dir=/tmp/runs/tiny-dlm --out_dir=dlm_jax/default_models/tiny-dlm

A killed run resumes from its last orbax checkpoint when started again with the same --run_dir (same
data order and noise: both depend only on --seed and the step), also on another --mesh. The final
weights are written as a converted checkpoint directory (config.json, model.safetensors, tokenizer.json).

With --mesh (e.g. --mesh=data:2,fsdp:2,tensor:2; --cpu_devices=8 tries it on a CPU) the train state is
sharded over the devices (experiments.devices has the runtime flags, including the multi-process ones);
--batch_size must divide over data × fsdp. Only process 0 writes --out_dir and the metrics.
"""

from __future__ import annotations

import dataclasses
import json
import logging as python_logging
import os

from absl import app, flags, logging

from dlm_jax import config as config_lib
from dlm_jax import train_loop, training_data
from dlm_jax.tasks import gsm8k, synthetic
from experiments import devices

FLAGS = flags.FLAGS
flags.DEFINE_string("preset", None, "ModelConfig preset name (see dlm_jax.config.PRESETS).")
flags.DEFINE_string("config_json", None, "A ModelConfig as a JSON file path or an inline JSON object.")
flags.DEFINE_multi_string("override", [], "ModelConfig field overrides, key=value (JSON values), repeatable.")
flags.DEFINE_bool("ids_from_tokenizer", True, "Set vocab_size and the [PAD]/[BOS]/[EOS]/[MASK] ids from the "
                  "tokenizer when it has those tokens.")
flags.DEFINE_enum("objective", "sft", ["pretrain", "sft", "ar"], "Training objective.")
flags.DEFINE_enum("sink_token", "none", ["none", "front", "end"], "Extra sink token placement.")
flags.DEFINE_bool("zero_sink_value", False, "Keep the sink's embedding (hence its key and value) at zero.")
flags.DEFINE_integer("sink_token_id", None, "Vocabulary id of the sink; default: the tokenizer's [SINK].")
flags.DEFINE_string("data", "synthetic", "'synthetic' or a GSM8K-format JSONL file.")
flags.DEFINE_integer("train_size", 20000, "Synthetic training problems.")
flags.DEFINE_integer("eval_size", 200, "Synthetic test problems used for the held-out loss (0 = none).")
flags.DEFINE_integer("data_seed", 0, "Seed of the synthetic generator.")
flags.DEFINE_string("tokenizer", None, "tokenizer.json (or its directory) for JSONL data; synthetic builds its own.")
flags.DEFINE_integer("steps", 1000, "Optimizer steps.")
flags.DEFINE_integer("batch_size", 32, "Sequences per step.")
flags.DEFINE_integer("seq_len", 68, "Sequence length.")
flags.DEFINE_integer("prompt_len", 36, "Prompt region width for --objective=sft (left-padded).")
flags.DEFINE_float("lr", 1e-3, "Peak learning rate.")
flags.DEFINE_integer("warmup", 100, "Linear warmup steps.")
flags.DEFINE_float("end_lr_ratio", 0.1, "Final learning rate / peak.")
flags.DEFINE_float("weight_decay", 0.1, "AdamW weight decay (matrices only).")
flags.DEFINE_float("clip_norm", 1.0, "Global gradient-norm clip.")
flags.DEFINE_integer("seed", 0, "Initialisation, data order and noise seed.")
flags.DEFINE_string("run_dir", None, "Orbax checkpoints and metrics.jsonl; an existing run is resumed.")
flags.DEFINE_string("out_dir", None, "Final converted checkpoint directory.")
flags.DEFINE_integer("log_every", 50, "Steps between progress lines.")
flags.DEFINE_integer("checkpoint_every", 250, "Steps between orbax checkpoints.")
flags.DEFINE_enum("attention_impl", "chunked", ["chunked", "dense"], "Attention path.")


def _load_tokenizer():
  from tokenizers import Tokenizer  # pylint: disable=import-outside-toplevel
  if FLAGS.data == "synthetic" and FLAGS.tokenizer is None:
    return synthetic.build_tokenizer()
  if FLAGS.tokenizer is None:
    raise app.UsageError("--tokenizer is required with a JSONL --data file.")
  path = FLAGS.tokenizer
  return Tokenizer.from_file(os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path)


def _model_config(tokenizer) -> config_lib.ModelConfig:
  if (FLAGS.preset is None) == (FLAGS.config_json is None):
    raise app.UsageError("Give exactly one of --preset and --config_json.")
  if FLAGS.preset is not None:
    config = config_lib.preset(FLAGS.preset)
  else:
    text = FLAGS.config_json
    if not text.lstrip().startswith("{"):
      with open(text, encoding="utf-8") as f:
        text = f.read()
    config = config_lib.ModelConfig.from_json(text)
  changes = {}
  if FLAGS.ids_from_tokenizer:
    changes["vocab_size"] = tokenizer.get_vocab_size()
    for field, token in (("pad_token_id", "[PAD]"), ("bos_token_id", "[BOS]"), ("eos_token_id", "[EOS]"),
                         ("mask_token_id", "[MASK]")):
      token_id = tokenizer.token_to_id(token)
      if token_id is not None and (field != "mask_token_id" or not config.causal):
        changes[field] = token_id
    if config.eot_token_id is not None and config.eot_token_id >= changes["vocab_size"]:
      changes["eot_token_id"] = None
  for item in FLAGS.override:
    key, _, value = item.partition("=")
    try:
      changes[key] = json.loads(value)
    except json.JSONDecodeError:
      changes[key] = value
  return config.replace(**changes)


def _pairs(split: str) -> list[tuple[str, str]]:
  if FLAGS.data == "synthetic":
    n = FLAGS.train_size if split == "train" else FLAGS.eval_size
    if n == 0:
      return []
    problems = synthetic.make_split(split, n, FLAGS.data_seed)
  elif split == "train":
    problems = gsm8k.read_jsonl(FLAGS.data)
  else:
    return []
  return [(p.question, p.answer) for p in problems]


def _quiet_orbax() -> None:
  """Drops orbax's per-save INFO lines (they share absl's logger) so progress lines stay readable."""
  logging.get_absl_handler().addFilter(
      lambda record: record.levelno >= python_logging.WARNING or "orbax" not in record.pathname)


def main(argv):
  del argv
  _quiet_orbax()
  runtime = devices.init_runtime()
  tokenizer = _load_tokenizer()
  config = _model_config(tokenizer)
  sink_id = FLAGS.sink_token_id
  if sink_id is None and FLAGS.sink_token != "none":
    sink_id = tokenizer.token_to_id("[SINK]")
    if sink_id is None:
      raise app.UsageError("The tokenizer has no [SINK] token; pass --sink_token_id.")
  train_config = train_loop.TrainConfig(
      objective=FLAGS.objective, sink=FLAGS.sink_token, sink_token_id=sink_id, zero_sink_value=FLAGS.zero_sink_value,
      steps=FLAGS.steps, batch_size=FLAGS.batch_size, lr=FLAGS.lr, warmup=FLAGS.warmup,
      end_lr_ratio=FLAGS.end_lr_ratio, weight_decay=FLAGS.weight_decay, clip_norm=FLAGS.clip_norm, seed=FLAGS.seed,
      checkpoint_every=FLAGS.checkpoint_every, log_every=FLAGS.log_every, attention_impl=FLAGS.attention_impl)
  layout = {"sft": "sft", "pretrain": "document", "ar": "ar"}[FLAGS.objective]
  ids = training_data.SpecialIds(pad=config.pad_token_id if config.pad_token_id is not None else config.eos_token_id,
                                 bos=config.bos_token_id, eos=config.eos_token_id)
  encode = lambda text: tokenizer.encode(text, add_special_tokens=False).ids

  def examples(split):
    pairs = _pairs(split)
    if not pairs:
      return None
    return training_data.encode_examples(pairs, encode, layout, ids, seq_len=FLAGS.seq_len,
                                         prompt_len=FLAGS.prompt_len if layout == "sft" else None)

  train_examples, eval_examples = examples("train"), examples("test")
  logging.info("model %s (%d layers, d_model %d, vocab %d); %d training sequences of %d tokens; %s",
               config.name, config.n_layers, config.d_model, config.vocab_size, len(train_examples),
               train_examples.seq_len, train_config)
  result = train_loop.train(config, train_config, train_examples, run_dir=FLAGS.run_dir, log=logging.info,
                            mesh=runtime.mesh)
  summary = {"step": result.step, "final_train_metrics": result.metrics, "wall_s_this_invocation": result.wall_s,
             "resumed_from": result.resumed_from, "stopped_early": result.stopped_early}
  if eval_examples is not None and not result.stopped_early:
    summary["heldout_loss"] = train_loop.evaluate_loss(config, train_config, result.params, eval_examples,
                                                       mesh=runtime.mesh)
  logging.info("summary %s", json.dumps(summary))
  if FLAGS.out_dir and not result.stopped_early and runtime.primary:
    record = {"train_config": dataclasses.asdict(train_config), "summary": summary,
              "data": {"data": FLAGS.data, "train_size": FLAGS.train_size, "data_seed": FLAGS.data_seed,
                       "seq_len": FLAGS.seq_len, "prompt_len": FLAGS.prompt_len, "layout": layout}}
    train_loop.save_converted(FLAGS.out_dir, config, result.params, tokenizer, training_record=record)
    logging.info("wrote %s", FLAGS.out_dir)


if __name__ == "__main__":
  app.run(main)
