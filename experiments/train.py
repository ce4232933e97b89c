"""Trains a model with masked diffusion (pretrain / SFT), next-token prediction, the extra sink token, or
DiffusionGemma-style uniform-state diffusion (--objective=uniform, a DiffusionGemma-style --preset such as
tiny-diffusiongemma; the sft layout, the prompt encoded causally and the answer as the canvas;
`dlm_jax.training.uniform`).

Examples (the embedded default models; see BUILD.md for the exact commands and timings):

  python -m experiments.train --preset=tiny-llada --override=d_model=128 ... --objective=sft \
      --data=synthetic --train_steps=3000 --run_dir=/tmp/runs/tiny-dlm --out_dir=dlm_jax/default_models/tiny-dlm

A killed run resumes from its last orbax checkpoint when started again with the same --run_dir (same
data order and noise: both depend only on --seed and the step), also on another --mesh. The final
weights are written as a converted checkpoint directory (config.json, model.safetensors, tokenizer.json).

With --mesh (e.g. --mesh=data:2,fsdp:2,tensor:2; --cpu_devices=8 tries it on a CPU) the train state is
sharded over the devices (experiments.common.devices has the runtime flags, including the multi-process ones);
--train_batch_size must divide over data × fsdp. The training flags (--train_steps, --train_batch_size,
--lr, ...) are shared with experiments.sink_token (`experiments.common.train_flags`); --steps and --batch_size
are aliases of --train_steps and --train_batch_size. Only process 0 writes --out_dir and the metrics.
"""

from __future__ import annotations

import dataclasses
import json
import os

from absl import flags, logging

from dlm_jax import config as config_lib
from dlm_jax.io import json_files, output_dir
from dlm_jax.training import data as training_data, loop as train_loop
from dlm_jax.tasks import gsm8k, synthetic
from dlm_jax.session import size_limits
from experiments.common import runtime_flags, cli, devices, flag_checks, progress, run_dir, train_flags

train_flags.define(train_steps=1000, train_batch_size=32, lr=1e-3, warmup=100, log_every=50, checkpoint_every=250,
                   preset=None)
flags.DEFINE_alias("steps", "train_steps")
flags.DEFINE_alias("batch_size", "train_batch_size")
_CONFIG_JSON = flags.DEFINE_string("config_json", None, "A ModelConfig as a JSON file path or an inline JSON object "
                                   "(instead of --preset).")
_IDS_FROM_TOKENIZER = flags.DEFINE_bool("ids_from_tokenizer", True, "Set vocab_size and the [PAD]/[BOS]/[EOS]/"
                                        "[MASK] ids from the tokenizer when it has those tokens.")
_OBJECTIVE = flags.DEFINE_enum("objective", "sft", ["pretrain", "sft", "ar", "uniform"], "Training objective "
                               "(uniform: DiffusionGemma-style uniform-state noise with self-conditioning, on the "
                               "sft layout; dlm_jax.training.uniform).")
_SELF_CONDITIONING_RATE = flags.DEFINE_float("self_conditioning_rate", 0.5, "--objective=uniform: fraction of rows "
                                             "trained with the first pass's logits as self-conditioning input.")
_SINK_TOKEN = flags.DEFINE_enum("sink_token", "none", ["none", "front", "end"], "Extra sink token placement.")
_ZERO_SINK_VALUE = flags.DEFINE_bool("zero_sink_value", False, "Keep the sink's embedding (hence its key and value) "
                                     "at zero.")
_SINK_TOKEN_ID = flags.DEFINE_integer("sink_token_id", None, "Vocabulary id of the sink; default: the tokenizer's "
                                      "[SINK].")
_DATA = flags.DEFINE_string("data", "synthetic", "'synthetic' or a GSM8K-format JSONL file.")
_TRAIN_SIZE = flags.DEFINE_integer("train_size", 20000, "Synthetic training problems (>= 1).")
_EVAL_SIZE = flags.DEFINE_integer("eval_size", 200, "Synthetic test problems used for the held-out loss (0 = none).")
_DATA_SEED = flags.DEFINE_integer("data_seed", 0, "Seed of the synthetic generator.")
_TOKENIZER = flags.DEFINE_string("tokenizer", None, "tokenizer.json (or its directory) for JSONL data; synthetic "
                                 "builds its own.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 68, "Sequence length.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 36, "Prompt region width for --objective=sft or uniform "
                                   "(left-padded).")
_SEED = flags.DEFINE_integer("seed", 0, "Initialisation, data order and noise seed.")
_RUN_DIR = flags.DEFINE_string("run_dir", None, "Orbax checkpoints and metrics.jsonl; an existing run is resumed.")
_OUT_DIR = flags.DEFINE_string("out_dir", None, "Final converted checkpoint directory (replaced when it exists).")
_ATTENTION_IMPL = flags.DEFINE_enum("attention_impl", "chunked", ["chunked", "dense"], "Attention path.")


@dataclasses.dataclass(frozen=True)
class DataSettings:
  """What the model is trained on: data ('synthetic' or a GSM8K-format JSONL path), its sizes and seed,
  the tokenizer path (JSONL data) and the sequence layout."""

  data: str
  train_size: int
  eval_size: int
  data_seed: int
  tokenizer: str | None
  seq_len: int
  prompt_len: int
  layout: str

  def __post_init__(self):
    if self.data != "synthetic":
      if not os.path.isfile(self.data):
        raise cli.UserError(f"--data={self.data}: expected 'synthetic' or an existing GSM8K-format .jsonl file")
      if self.tokenizer is None:
        raise cli.UsageError("--tokenizer is required with a JSONL --data file")
    if self.tokenizer is not None and not os.path.exists(self.tokenizer):
      raise cli.UserError(f"--tokenizer={self.tokenizer}: no such file or directory")
    flag_checks.positive(train_size=self.train_size)
    if self.eval_size < 0:
      raise cli.UserError(f"--eval_size={self.eval_size}: expected >= 0 (0 = no held-out loss)")
    if self.seq_len < 2:
      raise cli.UserError(f"--seq_len={self.seq_len}: expected at least 2")
    size_limits.check(train_size=self.train_size, eval_size=self.eval_size, seq_len=self.seq_len,
                      prompt_len=self.prompt_len)
    if self.layout == "sft" and not 1 <= self.prompt_len < self.seq_len:
      raise cli.UserError(f"--prompt_len={self.prompt_len}: expected 1 <= prompt_len < seq_len ({self.seq_len})")


def _load_tokenizer(data: DataSettings):
  from tokenizers import Tokenizer  # pylint: disable=import-outside-toplevel
  if data.tokenizer is None:
    return synthetic.build_tokenizer()
  path = data.tokenizer
  return Tokenizer.from_file(os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path)


def _model_config(tokenizer, preset: str | None, config_json: str | None, overrides: list[str],
                  ids_from_tokenizer: bool) -> config_lib.ModelConfig:
  """The model config of --preset or --config_json, with the tokenizer's ids and the overrides."""
  if (preset is None) == (config_json is None):
    raise cli.UsageError("give exactly one of --preset and --config_json")
  if preset is not None:
    config = train_flags.preset_config(preset, {})
  else:
    if config_json.lstrip().startswith("{"):
      values = json_files.parse_json(config_json.encode("utf-8"), "--config_json", cli.UserError)
    else:
      values = json_files.read_json(config_json, cli.UserError)
    config = config_lib.ModelConfig.from_dict(values)
  changes = {}
  if ids_from_tokenizer:
    changes["vocab_size"] = tokenizer.get_vocab_size()
    for field, token in (("pad_token_id", "[PAD]"), ("bos_token_id", "[BOS]"), ("eos_token_id", "[EOS]"),
                         ("mask_token_id", "[MASK]")):
      token_id = tokenizer.token_to_id(token)
      if token_id is not None and (field != "mask_token_id" or not config.causal):
        changes[field] = token_id
    if config.eot_token_id is not None and config.eot_token_id >= changes["vocab_size"]:
      changes["eot_token_id"] = None
  changes.update(train_flags.parse_overrides(overrides))
  return train_flags.replace(config, changes)


def _pairs(data: DataSettings, split: str) -> list[tuple[str, str]]:
  if data.data == "synthetic":
    n = data.train_size if split == "train" else data.eval_size
    if n == 0:
      return []
    problems = synthetic.make_split(split, n, data.data_seed)
  elif split == "train":
    try:
      problems = gsm8k.read_jsonl(data.data)
    except ValueError as e:
      raise cli.UserError(f"--data: {e}") from None
  else:
    return []
  return [(p.question, p.answer) for p in problems]


def main(argv):
  del argv
  progress.quiet_orbax()
  runtime_settings = runtime_flags.from_flags()
  layout = {"sft": "sft", "uniform": "sft", "pretrain": "document", "ar": "ar"}[_OBJECTIVE.value]
  data = DataSettings(data=_DATA.value, train_size=_TRAIN_SIZE.value, eval_size=_EVAL_SIZE.value,
                      data_seed=_DATA_SEED.value, tokenizer=_TOKENIZER.value, seq_len=_SEQ_LEN.value,
                      prompt_len=_PROMPT_LEN.value, layout=layout)
  flag_checks.not_blank(run_dir=_RUN_DIR.value, out_dir=_OUT_DIR.value)
  if _OUT_DIR.value:
    run_dir.check_output_file(os.path.join(_OUT_DIR.value, "config.json"), "out_dir")
    inputs = [p for p in (_TOKENIZER.value, _RUN_DIR.value, _DATA.value if _DATA.value != "synthetic" else None) if p]
    output_dir.check_not_over_sources(_OUT_DIR.value, inputs)
  if _RUN_DIR.value and os.path.isfile(_RUN_DIR.value):
    raise cli.UserError(f"--run_dir={_RUN_DIR.value} is a file; expected a directory")
  if _RUN_DIR.value:
    cli.set_resume_hint(f"run the same command again to resume from the last checkpoint in {_RUN_DIR.value}")
  tokenizer = _load_tokenizer(data)
  config = _model_config(tokenizer, flags.FLAGS.preset, _CONFIG_JSON.value, flags.FLAGS.override,
                         _IDS_FROM_TOKENIZER.value)
  sink_id = _SINK_TOKEN_ID.value
  if sink_id is None and _SINK_TOKEN.value != "none":
    sink_id = tokenizer.token_to_id("[SINK]")
    if sink_id is None:
      raise cli.UsageError("the tokenizer has no [SINK] token; pass --sink_token_id")
  train_config = train_flags.train_config(objective=_OBJECTIVE.value, sink=_SINK_TOKEN.value, sink_token_id=sink_id,
                                          zero_sink_value=_ZERO_SINK_VALUE.value, seed=_SEED.value,
                                          attention_impl=_ATTENTION_IMPL.value,
                                          prompt_len=data.prompt_len if _OBJECTIVE.value == "uniform" else None,
                                          self_conditioning_rate=_SELF_CONDITIONING_RATE.value)
  if not 0.0 <= train_config.self_conditioning_rate <= 1.0:
    raise cli.UserError(f"--self_conditioning_rate={train_config.self_conditioning_rate}: expected a value in [0, 1]")
  runtime = devices.init_runtime(runtime_settings)
  train_flags.check_fits(config, train_config, runtime.mesh)
  ids = training_data.SpecialIds(pad=config.pad_token_id if config.pad_token_id is not None else config.eos_token_id,
                                 bos=config.bos_token_id, eos=config.eos_token_id)
  encode = lambda text: tokenizer.encode(text, add_special_tokens=False).ids

  def examples(split):
    pairs = _pairs(data, split)
    if not pairs:
      return None
    return training_data.encode_examples(pairs, encode, layout, ids, seq_len=data.seq_len,
                                         prompt_len=data.prompt_len if layout == "sft" else None)

  train_examples, eval_examples = examples("train"), examples("test")
  logging.info("model %s (%d layers, d_model %d, vocab %d); %d training sequences of %d tokens; %s",
               config.name, config.n_layers, config.d_model, config.vocab_size, len(train_examples),
               train_examples.seq_len, train_config)
  result = train_loop.train(config, train_config, train_examples, run_dir=_RUN_DIR.value, log=logging.info,
                            mesh=runtime.mesh)
  summary = {"step": result.step, "final_train_metrics": result.metrics, "wall_s_this_invocation": result.wall_s,
             "resumed_from": result.resumed_from, "stopped_early": result.stopped_early}
  if eval_examples is not None and not result.stopped_early:
    summary["heldout_loss"] = train_loop.evaluate_loss(config, train_config, result.params, eval_examples,
                                                       mesh=runtime.mesh)
  logging.info("summary %s", json.dumps(summary))
  if _OUT_DIR.value and not result.stopped_early and runtime.primary:
    record = {"train_config": dataclasses.asdict(train_config), "summary": summary,
              "data": {k: v for k, v in dataclasses.asdict(data).items() if k not in ("eval_size", "tokenizer")}}
    train_loop.save_converted(_OUT_DIR.value, config, result.params, tokenizer, training_record=record)
    logging.info("wrote %s", _OUT_DIR.value)


if __name__ == "__main__":
  cli.run(main)
