"""The training flags shared by `experiments.train` and `experiments.sink_token`, turned into a
`dlm_jax.training.loop.TrainConfig` and a `ModelConfig`.

Each binary calls `define(...)` once at import with its own defaults; the flags are --train_steps,
--train_batch_size, --lr, --warmup, --end_lr_ratio, --weight_decay, --clip_norm, --log_every,
--checkpoint_every, --preset and --override (repeatable key=value ModelConfig changes, JSON values).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from absl import flags

from dlm_jax import config as config_lib
from dlm_jax.training import loop as train_loop
from experiments.common.cli import UserError

FLAGS = flags.FLAGS


def define(*, train_steps: int, train_batch_size: int, lr: float, warmup: int, log_every: int,
           checkpoint_every: int, preset: str | None) -> None:
  """Defines the shared training flags with this binary's defaults."""
  flags.DEFINE_integer("train_steps", train_steps, "Optimizer steps (>= 1).")
  flags.DEFINE_integer("train_batch_size", train_batch_size, "Sequences per optimizer step (>= 1).")
  flags.DEFINE_float("lr", lr, "Peak learning rate (> 0).")
  flags.DEFINE_integer("warmup", warmup, "Linear warmup steps (>= 0).")
  flags.DEFINE_float("end_lr_ratio", 0.1, "Final learning rate / peak, in [0, 1].")
  flags.DEFINE_float("weight_decay", 0.1, "AdamW weight decay (matrices only), >= 0.")
  flags.DEFINE_float("clip_norm", 1.0, "Global gradient-norm clip (> 0).")
  flags.DEFINE_integer("log_every", log_every, "Steps between progress lines and loss-curve points (>= 1).")
  flags.DEFINE_integer("checkpoint_every", checkpoint_every, "Steps between orbax checkpoints (0 = only at the "
                       "end and on a signal).")
  flags.DEFINE_string("preset", preset, "ModelConfig preset name (see dlm_jax.config.PRESETS).")
  flags.DEFINE_multi_string("override", [], "ModelConfig field overrides, key=value (JSON values), repeatable.")


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
  """--override values as {field: value} (a value that is not JSON is taken as a string)."""
  changes = {}
  for item in items:
    key, sep, value = item.partition("=")
    if not sep or not key:
      raise UserError(f"--override={item}: expected FIELD=VALUE, e.g. --override=d_model=128")
    try:
      changes[key] = json.loads(value)
    except json.JSONDecodeError:
      changes[key] = value
  return changes


def preset_config(preset: str | None, changes: dict[str, Any]) -> config_lib.ModelConfig:
  """The config of --preset with `changes` applied (unknown presets and fields are one-line errors)."""
  if preset is None:
    raise UserError("--preset is required")
  return replace(config_lib.preset(preset), changes)


def replace(config: config_lib.ModelConfig, changes: dict[str, Any]) -> config_lib.ModelConfig:
  """`config.replace(**changes)` with an unknown field reported as a one-line error."""
  fields = set(config_lib.ModelConfig.__dataclass_fields__)
  unknown = sorted(set(changes) - fields)
  if unknown:
    raise UserError(f"--override {unknown[0]}: ModelConfig has no such field (fields: {', '.join(sorted(fields))})")
  return config.replace(**changes)


def train_config(*, objective: str, sink: str, sink_token_id: int | None, zero_sink_value: bool, seed: int,
                 attention_impl: str, prompt_len: int | None = None,
                 self_conditioning_rate: float = 0.5) -> train_loop.TrainConfig:
  """The training flags as a validated `TrainConfig` (every value range checked)."""
  checks = [("train_steps", FLAGS.train_steps >= 1, "a positive integer"),
            ("train_batch_size", FLAGS.train_batch_size >= 1, "a positive integer"),
            ("lr", FLAGS.lr > 0, "> 0"), ("warmup", FLAGS.warmup >= 0, ">= 0"),
            ("end_lr_ratio", 0 <= FLAGS.end_lr_ratio <= 1, "a value in [0, 1]"),
            ("weight_decay", FLAGS.weight_decay >= 0, ">= 0"), ("clip_norm", FLAGS.clip_norm > 0, "> 0"),
            ("log_every", FLAGS.log_every >= 1, "a positive integer"),
            ("checkpoint_every", FLAGS.checkpoint_every >= 0, ">= 0 (0 = only at the end)")]
  for name, ok, expected in checks:
    if not ok:
      raise UserError(f"--{name}={FLAGS[name].value}: expected {expected}")
  return train_loop.TrainConfig(
      objective=objective, sink=sink, sink_token_id=sink_token_id, zero_sink_value=zero_sink_value,
      steps=FLAGS.train_steps, batch_size=FLAGS.train_batch_size, lr=FLAGS.lr, warmup=FLAGS.warmup,
      end_lr_ratio=FLAGS.end_lr_ratio, weight_decay=FLAGS.weight_decay, clip_norm=FLAGS.clip_norm, seed=seed,
      checkpoint_every=FLAGS.checkpoint_every, log_every=FLAGS.log_every, attention_impl=attention_impl,
      prompt_len=prompt_len, self_conditioning_rate=self_conditioning_rate)


def check_fits(model_config: config_lib.ModelConfig, tc: train_loop.TrainConfig, mesh) -> None:
  """Refuses an objective that does not fit the model, or a batch that does not divide over the mesh."""
  try:
    tc.objective_spec().check(model_config)
    if mesh is not None:
      from dlm_jax.runtime import sharding  # pylint: disable=import-outside-toplevel
      sharding.check_batch(tc.batch_size, mesh)
  except ValueError as e:
    raise UserError(str(e)) from None
