"""Loader of the local synthetic tasks: synthetic_test.jsonl (16 test problems of
`dlm_jax.tasks.synthetic.make_split("test", 16, seed=0)`; `choices` holds the worked answer and three
copies with the final number replaced by the nearest other values in [0, MAX_VALUE], the answer at index
`label` = item index mod 4) as a datasets split "test"."""

import json
import os

import datasets

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "synthetic_test.jsonl")


def load_synthetic(**kwargs):
  """{"test": Dataset} of synthetic_test.jsonl (lm-eval passes its metadata as kwargs; unused)."""
  del kwargs
  with open(DATA, encoding="utf-8") as f:
    rows = [json.loads(line) for line in f if line.strip()]
  return {"test": datasets.Dataset.from_list(rows)}
