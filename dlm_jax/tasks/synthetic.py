"""A synthetic multi-step arithmetic word-problem task in GSM8K format, and its word-level tokenizer.

Example (question / answer):

    Tom has 7 apples. He buys 5 more. He buys 3 bags of 4 apples. He loses 2. How many apples does Tom have?
    7 + 5 = 12. 3 * 4 = 12. 12 + 12 = 24. 24 - 2 = 22. #### 22

Each problem starts from a count and applies 2–3 steps: buy/find/receive b more (+), give away/lose/sell b
(−), or buy k bags of b (k·b, then +). Every intermediate count stays in [0, MAX_VALUE]. Numbers are
single tokens, so the whole task is a small closed vocabulary that a tiny model can learn on a CPU.

Splits are disjoint by construction: a question belongs to "test" when the SHA-256 of its text falls in
the test bucket (1 in TEST_BUCKETS) and to "train" otherwise; `make_split` draws problems from a seeded
generator, keeps those of the requested split and drops duplicates, so the same (split, n, seed) always
gives the same list.
"""

from __future__ import annotations

import hashlib
import random

from dlm_jax.tasks.gsm8k import Problem

MAX_VALUE = 40
TEST_BUCKETS = 10
SPECIAL_TOKENS = ("[PAD]", "[BOS]", "[EOS]", "[MASK]", "[SINK]", "[UNK]")
"""Special tokens of the synthetic tokenizer, with ids 0..5 in this order."""

# (name, subject pronoun, object pronoun)
NAMES = (("Tom", "He", "him"), ("Anna", "She", "her"), ("Ben", "He", "him"), ("Lily", "She", "her"),
         ("Sam", "He", "him"), ("Mia", "She", "her"), ("Max", "He", "him"), ("Zoe", "She", "her"))
OBJECTS = ("apples", "pens", "books", "coins", "cards", "eggs", "marbles", "stickers", "shells", "stamps")
_ADD = ("{S} buys {b} more.", "{S} finds {b} more.", "{F} gives {O} {b} more.")
_SUB = ("{S} gives away {b}.", "{S} loses {b}.", "{S} sells {b}.")
_BAGS = "{S} buys {k} bags of {b} {obj}."
_QUESTION = "How many {obj} does {N} have?"


def _step(rng: random.Random, value: int, name: tuple[str, str, str], friend: str, obj: str, allow_bags: bool):
  """One random step from `value`: (sentence, [equations], new value), or None if it leaves the range."""
  subject, obj_pronoun = name[1], name[2]
  kind = rng.choice(("add", "sub", "bags") if allow_bags else ("add", "sub"))
  if kind == "add":
    b = rng.randint(1, 9)
    if value + b > MAX_VALUE:
      return None
    text = rng.choice(_ADD).format(S=subject, F=friend, O=obj_pronoun, b=b)
    return text, [f"{value} + {b} = {value + b}."], value + b
  if kind == "sub":
    b = rng.randint(1, 9)
    if b > value:
      return None
    text = rng.choice(_SUB).format(S=subject, b=b)
    return text, [f"{value} - {b} = {value - b}."], value - b
  k, b = rng.randint(2, 4), rng.randint(2, 5)
  if value + k * b > MAX_VALUE:
    return None
  text = _BAGS.format(S=subject, k=k, b=b, obj=obj)
  return text, [f"{k} * {b} = {k * b}.", f"{value} + {k * b} = {value + k * b}."], value + k * b


def generate_problem(rng: random.Random) -> Problem:
  """One problem drawn from `rng` (2–3 steps, at most one 'bags' step)."""
  while True:
    name = rng.choice(NAMES)
    friend = rng.choice([n[0] for n in NAMES if n != name])
    obj = rng.choice(OBJECTS)
    value = rng.randint(2, 20)
    sentences, equations = [f"{name[0]} has {value} {obj}."], []
    bags_used = False
    for _ in range(rng.randint(2, 3)):
      step = _step(rng, value, name, friend, obj, allow_bags=not bags_used)
      if step is None:
        break
      text, eqs, value = step
      bags_used |= len(eqs) == 2
      sentences.append(text)
      equations.extend(eqs)
    else:
      sentences.append(_QUESTION.format(obj=obj, N=name[0]))
      return Problem(question=" ".join(sentences), answer=" ".join(equations + [f"#### {value}"]))


def split_of(question: str) -> str:
  """'test' or 'train', from a hash of the question text (stable across runs and platforms)."""
  bucket = int.from_bytes(hashlib.sha256(question.encode("utf-8")).digest()[:8], "big") % TEST_BUCKETS
  return "test" if bucket == 0 else "train"


def make_split(split: str, n: int, seed: int = 0) -> list[Problem]:
  """`n` distinct problems of `split` ("train" or "test"), deterministic in (split, n, seed)."""
  if split not in ("train", "test"):
    raise ValueError(f"split must be 'train' or 'test', got {split!r}.")
  rng = random.Random(f"synthetic-{seed}")
  problems, seen = [], set()
  attempts = 0
  while len(problems) < n:
    attempts += 1
    if attempts > 200 * n + 10_000:
      raise RuntimeError(f"Could not draw {n} distinct {split} problems; the task has too few.")
    p = generate_problem(rng)
    if p.question in seen or split_of(p.question) != split:
      continue
    seen.add(p.question)
    problems.append(p)
  return problems


def vocabulary() -> list[str]:
  """Every token of the task: the specials (ids 0..5), numbers 0..MAX_VALUE, words and punctuation."""
  words = {"has", "buys", "more", "finds", "gives", "away", "loses", "sells", "bags", "of", "How", "many",
           "does", "have", ".", "?", "+", "-", "*", "=", "####"}
  for name, subject, obj_pronoun in NAMES:
    words.update((name, subject, obj_pronoun))
  words.update(OBJECTS)
  return list(SPECIAL_TOKENS) + [str(i) for i in range(MAX_VALUE + 1)] + sorted(words)


def build_tokenizer():
  """A `tokenizers.Tokenizer` (WordLevel over `vocabulary()`, whitespace/punctuation pre-tokenizer).

  Special tokens: [PAD] 0, [BOS] 1, [EOS] 2, [MASK] 3, [SINK] 4, [UNK] 5. Decoding joins tokens with
  spaces ("3 + 5 = 8. #### 8" decodes as "3 + 5 = 8 . #### 8"), which the GSM8K extractors accept.
  """
  from tokenizers import Tokenizer, models, pre_tokenizers  # pylint: disable=import-outside-toplevel

  vocab = {token: i for i, token in enumerate(vocabulary())}
  tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
  tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
  tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
  return tokenizer
