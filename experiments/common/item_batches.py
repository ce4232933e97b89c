"""The batches of a run: fixed groups of items (so a resumed run recomputes exactly the batches of an
uninterrupted one), each with its padded prompts and its PRNG key."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import jax
import numpy as np

from experiments.common import decoding, devices, prompts
from experiments.common.items import Item


def fixed_batches(n_items: int, batch_size: int) -> list[list[int]]:
  """Item indices in consecutive batches of `batch_size` (the last one shorter)."""
  return [list(range(s, min(s + batch_size, n_items))) for s in range(0, n_items, batch_size)]


@dataclasses.dataclass
class Batch:
  """items: the real items; prompts: their [rows, W] prompts (rows rounded up to the mesh's batch shards,
  extra rows repeat the last item); key: the PRNG key(s) of the call (`decoding.batch_key`)."""

  items: list[Item]
  prompts: prompts.Prompts
  key: jax.Array


def batches(items: list[Item], prompt_set: prompts.PromptSet, batch_size: int, seed: int,
            runtime: devices.Runtime, done: Callable[[Item], bool]) -> Iterator[Batch]:
  """The batches with at least one item not `done`, in order."""
  rows = runtime.round_batch(batch_size)
  for indices in fixed_batches(len(items), batch_size):
    chunk = [items[i] for i in indices]
    if all(done(item) for item in chunk):
      continue
    ids = [item.id for item in chunk]
    key = decoding.batch_key(seed, ids + ids[-1:] * (rows - len(ids)))
    yield Batch(chunk, prompts.batch(prompt_set, chunk, rows), key)


def pad_rows(array: np.ndarray, size: int) -> np.ndarray:
  """Pads the batch axis to `size` rows by repeating the last row (padding rows are discarded)."""
  array = np.asarray(array)
  if array.shape[0] >= size:
    return array
  return np.concatenate([array, np.repeat(array[-1:], size - array.shape[0], axis=0)], axis=0)
