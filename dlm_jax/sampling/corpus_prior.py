"""PC-Sampler's corpus frequency prior: a file of token counts tied to one tokenizer.

PC-Sampler's calibration divides out how common a token is in a reference corpus (NEUIR/PC-Sampler reads a
JSON `{"num_token": N, "p_baseline_dict": {id: count}}` and uses count / N, or 1 / N for an id it never
saw). Our file is a JSON object:

    {"format": "dlm_jax.corpus_prior", "version": 1,
     "tokenizer": {"vocab_size": V, "sha256": <vocab_sha256 of the tokenizer's vocabulary>},
     "num_tokens": N, "counts": {"<id>": count, ...}, "sha256": <SHA-256 of the canonical JSON of the rest>}

and `load` refuses, in one line, a missing file, one that is not such an object (torn, truncated, edited:
the checksum fails), and one made for another tokenizer (its vocabulary digest or size differs). Frequencies
are count / N, 1 / N for ids absent from `counts` (as the original).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterable, Mapping

import numpy as np

FORMAT = "dlm_jax.corpus_prior"
VERSION = 1


def vocab_sha256(vocab: Mapping[str, int]) -> str:
  """The identity of a tokenizer's vocabulary: SHA-256 of its (id, token) pairs sorted by id, as JSON."""
  pairs = sorted((int(i), str(t)) for t, i in vocab.items())
  return hashlib.sha256(json.dumps(pairs, ensure_ascii=False).encode("utf-8")).hexdigest()


@dataclasses.dataclass(frozen=True, eq=False)
class CorpusPrior:
  """A loaded prior: frequencies [vocab_size] float32 (sum of the seen ids' shares plus 1/N for each unseen
  id), the tokenizer it belongs to, the corpus size and `digest` (the file's checksum; equality and hash)."""

  frequencies: np.ndarray
  vocab_size: int
  tokenizer_sha256: str
  num_tokens: int
  digest: str

  def __eq__(self, other):
    return isinstance(other, CorpusPrior) and self.digest == other.digest

  def __hash__(self):
    return hash(self.digest)


def _body_digest(body: dict) -> str:
  return hashlib.sha256(json.dumps(body, sort_keys=True).encode("utf-8")).hexdigest()


def _from_body(body: dict, digest: str) -> CorpusPrior:
  vocab_size, total = body["tokenizer"]["vocab_size"], body["num_tokens"]
  frequencies = np.full((vocab_size,), 1.0 / total, np.float32)
  for token, count in body["counts"].items():
    frequencies[int(token)] = count / total
  return CorpusPrior(frequencies=frequencies, vocab_size=vocab_size, tokenizer_sha256=body["tokenizer"]["sha256"],
                     num_tokens=total, digest=digest)


def count(sequences: Iterable[Iterable[int]], vocab: Mapping[str, int], vocab_size: int | None = None) -> dict:
  """The file's JSON object for token id sequences of the tokenizer with this vocabulary (vocab_size: the
  model's, default len(vocab)). Raises ValueError on an id outside the vocabulary or an empty corpus."""
  size = len(vocab) if vocab_size is None else vocab_size
  counts: dict[int, int] = {}
  for sequence in sequences:
    for token in sequence:
      token = int(token)
      if not 0 <= token < size:
        raise ValueError(f"corpus prior: token id {token} is outside the vocabulary of {size} ids.")
      counts[token] = counts.get(token, 0) + 1
  total = sum(counts.values())
  if total == 0:
    raise ValueError("corpus prior: the corpus holds no token; expected at least one tokenized text.")
  body = {"format": FORMAT, "version": VERSION, "tokenizer": {"vocab_size": size, "sha256": vocab_sha256(vocab)},
          "num_tokens": total, "counts": {str(k): counts[k] for k in sorted(counts)}}
  return dict(body, sha256=_body_digest(body))


def save(document: dict, path: str) -> None:
  """Writes `count`'s object to `path` atomically (temporary file, fsync, rename)."""
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  tmp = os.path.join(directory, f".tmp-{os.getpid()}-{os.path.basename(path)}")
  try:
    with open(tmp, "w", encoding="utf-8") as f:
      json.dump(document, f, sort_keys=True)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


def _valid_body(body) -> bool:
  try:
    return (body["format"] == FORMAT and body["version"] == VERSION and isinstance(body["num_tokens"], int)
            and body["num_tokens"] > 0 and isinstance(body["tokenizer"]["vocab_size"], int)
            and isinstance(body["tokenizer"]["sha256"], str) and isinstance(body["counts"], dict)
            and all(0 <= int(k) < body["tokenizer"]["vocab_size"] and isinstance(v, int) and v > 0
                    for k, v in body["counts"].items())
            and sum(body["counts"].values()) == body["num_tokens"])
  except (KeyError, TypeError, ValueError):
    return False


def load(path: str, vocab: Mapping[str, int] | None = None, vocab_size: int | None = None) -> CorpusPrior:
  """Reads a prior file, checking its format, checksum and (given) tokenizer vocabulary and model vocab size.
  Raises ValueError with one line naming the file and what was expected."""
  if not os.path.isfile(path):
    raise ValueError(f"pc prior {path}: no such file; expected a corpus prior JSON (dlm_jax.sampling.corpus_prior).")
  try:
    with open(path, encoding="utf-8") as f:
      document = json.load(f)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(f"pc prior {path}: not readable JSON ({type(e).__name__}); the file is torn or not a prior.")
  if not isinstance(document, dict) or "sha256" not in document:
    raise ValueError(f"pc prior {path}: not a {FORMAT} file (no checksum).")
  body = {k: v for k, v in document.items() if k != "sha256"}
  if not _valid_body(body) or _body_digest(body) != document["sha256"]:
    raise ValueError(f"pc prior {path}: its checksum or fields do not match; the file is torn or was edited.")
  prior = _from_body(body, document["sha256"])
  if vocab is not None and vocab_sha256(vocab) != prior.tokenizer_sha256:
    raise ValueError(f"pc prior {path}: made for another tokenizer (vocabulary digest "
                     f"{prior.tokenizer_sha256[:12]}…, this tokenizer's is {vocab_sha256(vocab)[:12]}…).")
  if vocab_size is not None and vocab_size != prior.vocab_size:
    raise ValueError(f"pc prior {path}: made for a vocabulary of {prior.vocab_size} ids, the model has {vocab_size}.")
  return prior


def from_document(document: dict) -> CorpusPrior:
  """A prior straight from `count`'s object (tests, in-memory use)."""
  body = {k: v for k, v in document.items() if k != "sha256"}
  return _from_body(body, document["sha256"])
