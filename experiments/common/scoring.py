"""Scoring one completion of an `experiments.common.items.Item`: GSM8K strict (`#### n`) and flexible (last
number) matches, "the answer appears in the reply", or HumanEval pass@1 in the sandbox (`dlm_jax.tasks.sandbox`)."""

from __future__ import annotations

import functools
import re
from typing import Any

from absl import logging

from dlm_jax.tasks import gsm8k
from experiments.common.items import Item

_CODE_BLOCK = re.compile(r"```(?:python|py)?\n(.*?)(?:```|$)", re.DOTALL)
_STOPS = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#")


def humaneval_code(completion: str, chat: bool) -> str:
  """The code to append to a HumanEval prompt: a fenced block's content when there is one (a chat
  reply; it may redefine the function, which then wins), else the raw continuation cut at the first
  top-level statement that starts something new."""
  match = _CODE_BLOCK.search(completion)
  if match:
    return "\n" + match.group(1)
  if chat:
    return completion
  cut = min((completion.find(s) for s in _STOPS if s in completion), default=len(completion))
  return completion[:cut]


def score(item: Item, completion: str, chat: bool = False) -> dict[str, Any]:
  """{"correct": bool, ...details} for one completion."""
  if item.kind == "gsm8k":
    result = next(gsm8k.iter_scores([gsm8k.Problem(item.question, item.target)], [completion]))
    return {"correct": bool(result["flexible_match"]), "strict_match": bool(result["strict_match"]),
            "flexible_match": bool(result["flexible_match"]), "extracted": result["flexible"],
            "target": result["target"]}
  if item.kind == "contains":
    hit = any(re.search(r"\b" + re.escape(a.lower()) + r"\b", completion.lower()) for a in item.target)
    return {"correct": bool(hit), "target": item.target}
  from dlm_jax.tasks import humaneval  # pylint: disable=import-outside-toplevel
  result = humaneval.check_completion(item.target, humaneval_code(completion, chat))
  _log_isolation(result.isolation)
  return {"correct": result.passed, "status": result.status}


@functools.lru_cache(maxsize=1)
def _log_isolation(isolation: tuple[str, ...]) -> None:
  """Says once what isolation HumanEval completions run under; a warning when a layer is missing."""
  degraded = any(line.startswith(("namespaces: none", "landlock: unavailable")) for line in isolation)
  (logging.warning if degraded else logging.info)(
      "HumanEval completions run sandboxed (%s)%s", "; ".join(isolation),
      "; run untrusted models in a container (docs/guides/trust.md)" if degraded else "")
