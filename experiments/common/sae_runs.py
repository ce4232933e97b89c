"""What the SAE binaries share: the synthetic task's items, the residual-stream activations a sampler run
holds at every step (the SAE's training and evaluation data), and the SAE directories of a training run.

Activations of a site at layer l are taken at every step of the model's sampler (temperature 0) at the
generated positions: one row per (item, step, generated position), in that order, with the row's step and
whether the position was still masked when the step ran (`Trace.decode_step`).
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from dlm_jax.instrument import sites
from dlm_jax.instrument.hook_spec import Capture, Hooks
from dlm_jax.runtime import distributed
from dlm_jax.tasks import synthetic
from experiments.common import decoding, item_batches, progress
from experiments.common.items import Item


def synthetic_items(split: str, n: int, data_seed: int) -> list[Item]:
  """The first n problems of the synthetic task's `split` ("train" or "test") as items."""
  return [Item(f"{split}-{i}", p.question, p.answer, "gsm8k")
          for i, p in enumerate(synthetic.make_split(split, n, data_seed))]


def sae_dir(output_dir: str, site: str) -> str:
  """Where a training run saves the SAE of `site` (SAELens format)."""
  return os.path.join(output_dir, "saes", site)


@dataclasses.dataclass
class Activations:
  """values {site name: [N, D] float32}; step [N] int32; masked [N] bool (rows as in the module docstring);
  tokens: [items, S] the final sequences."""

  values: dict[str, np.ndarray]
  step: np.ndarray
  masked: np.ndarray
  tokens: np.ndarray


def collect(model, values, prompt_set, items: list[Item], runtime, numerics, kind: str, layers: tuple[int, ...],
            batch_size: int, seed: int, label: str) -> Activations:
  """The activations of site `kind` at `layers` over every step of the sampler on `items` (module docstring)."""
  hooks = Hooks(captures=(Capture(kind, layers=layers),))
  names = [sites.full_name(kind, layer) for layer in layers]
  parts: dict[str, list[np.ndarray]] = {name: [] for name in names}
  steps, masked, tokens = [], [], []
  lp = prompt_set.width
  meter = progress.Progress(f"{label} activations", len(items))
  for batch in item_batches.batches(items, prompt_set, batch_size, seed, runtime, lambda item: False):
    trace = decoding.generate(model, values, batch.prompts, runtime, numerics, key=batch.key, hooks=hooks)
    n = len(batch.items)
    decode_step = distributed.to_host(trace.decode_step)[:n]
    tokens.append(distributed.to_host(trace.tokens)[:n])
    captured = {name: distributed.to_host(trace.captures[name])[:, :n, lp:] for name in names}
    n_steps, _, gen = captured[names[0]].shape[:3]
    still_masked = (decode_step[None] >= np.arange(n_steps)[:, None, None]) | (decode_step[None] < 0)
    for name in names:
      parts[name].append(np.transpose(captured[name], (1, 0, 2, 3)).reshape(n * n_steps * gen, -1))
    steps.append(np.broadcast_to(np.arange(n_steps)[None, :, None], (n, n_steps, gen)).reshape(-1))
    masked.append(np.transpose(still_masked, (1, 0, 2)).reshape(-1))
    meter.update(n)
  return Activations(values={name: np.concatenate(parts[name]).astype(np.float32) for name in names},
                     step=np.concatenate(steps).astype(np.int32), masked=np.concatenate(masked),
                     tokens=np.concatenate(tokens))
