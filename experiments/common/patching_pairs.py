"""Clean / corrupted prompt pairs of experiments.activation_patching: the synthetic task's problems with one
operand changed (`dlm_jax.tasks.synthetic_pairs`), tokenized in the model's training layout, with the
answer position and the two answer tokens the metric compares."""

from __future__ import annotations

import dataclasses
import random

from dlm_jax.tasks import synthetic, synthetic_pairs
from dlm_jax.session.checkpoint_bundle import Model
from experiments.common import decoding, prompts
from experiments.common.items import Item


@dataclasses.dataclass(frozen=True)
class PromptPair:
  """One pair. id: the clean item's id (its index in the synthetic test split); pair: the two problems;
  answer_index: the generated position (0-based, from the first generated token) of the first answer token
  that differs between the two reference answers (the number after the last ####);
  clean_token / corrupted_token: the reference answers' tokens there."""

  id: str
  pair: synthetic_pairs.Pair
  answer_index: int
  clean_token: int
  corrupted_token: int

  @property
  def items(self) -> tuple[Item, Item]:
    """The clean and the corrupted prompt as items (ids "<id>" and "<id>/corrupted")."""
    p = self.pair
    return (Item(self.id, p.clean.question, p.clean.answer, "gsm8k"),
            Item(f"{self.id}/corrupted", p.corrupted.question, p.corrupted.answer, "gsm8k"))


@dataclasses.dataclass(frozen=True)
class PairSet:
  """pairs: the usable pairs; skipped: {reason: count} of the problems left out (no operand could change;
  the two prompts or answers tokenize to different lengths; the answers do not differ after ####)."""

  pairs: list[PromptPair]
  skipped: dict[str, int]


def _answer_index(model: Model, clean: list[int], corrupted: list[int], answer: str) -> int | None:
  start = len(model.tokenizer.encode(answer[:answer.rindex("####") + len("####")]))
  return next((i for i in range(start, len(clean)) if clean[i] != corrupted[i]), None)


def build(model: Model, n_pairs: int, data_seed: int, seed: int) -> PairSet:
  """The first n_pairs problems of the synthetic test split (seed data_seed) as pairs; the changed operand
  of problem i is drawn from Random(f"{seed}-{i}"), so a pair does not depend on the others."""
  tok = model.tokenizer
  pairs, skipped = [], {"no_operand": 0, "length_mismatch": 0, "same_answer_tokens": 0}
  for index, problem in enumerate(synthetic.make_split("test", n_pairs, data_seed)):
    pair = synthetic_pairs.corrupt(problem, random.Random(f"{seed}-{index}"))
    if pair is None:
      skipped["no_operand"] += 1
      continue
    clean, corrupted = tok.encode(pair.clean.answer), tok.encode(pair.corrupted.answer)
    if (len(tok.encode(pair.clean.question)) != len(tok.encode(pair.corrupted.question))
        or len(clean) != len(corrupted)):
      skipped["length_mismatch"] += 1
      continue
    at = _answer_index(model, clean, corrupted, pair.clean.answer)
    if at is None:
      skipped["same_answer_tokens"] += 1
      continue
    pairs.append(PromptPair(str(index), pair, at, clean[at], corrupted[at]))
  return PairSet(pairs, skipped)


def prompt_set(model: Model, pairs: list[PromptPair]) -> prompts.PromptSet:
  """Every clean and corrupted prompt of the run, at one width."""
  return prompts.encode(model, [item for p in pairs for item in p.items])


def batch(prompt_set_: prompts.PromptSet, pairs: list[PromptPair], corrupted_only: bool = False, repeat: int = 1
          ) -> prompts.Prompts:
  """Rows: the clean prompts then the corrupted ones (or the corrupted ones only), each repeated `repeat`
  times in a row."""
  chosen = [p.items[1] for p in pairs] if corrupted_only else [p.items[0] for p in pairs] + [p.items[1] for p in pairs]
  rows = [item for item in chosen for _ in range(repeat)]
  return prompts.batch(prompt_set_, rows, len(rows))


def keys(seed: int, pairs: list[PromptPair], rows_per_pair: int, clean_and_corrupted: bool = False):
  """[R] PRNG keys: a pair's clean, corrupted and patched rows all share the pair's item key."""
  ids = [p.id for p in pairs for _ in range(rows_per_pair)]
  return decoding.batch_key(seed, ids * (2 if clean_and_corrupted else 1))
