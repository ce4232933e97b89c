"""Metrics over routing statistics (`StatsSpec.routing`): how the experts a mixture-of-experts router chose
are distributed over a set of tokens, e.g. the attention sinks against the other tokens.

Inputs are host NumPy arrays in the library layout: routed experts [..., L', S, k] int32 with −1 where no
choice was made (dense layers, positions a step did not compute).
"""

from __future__ import annotations

import numpy as np


def expert_counts(routed_experts: np.ndarray, select: np.ndarray, n_experts: int) -> np.ndarray:
  """Routing slots per expert among the selected tokens, per layer.

  Args:
    routed_experts: [steps, L', S, k] int, −1 = no choice.
    select: [steps, L', S] bool, the (step, layer, position) entries to count; entries without a choice are
      never counted.
    n_experts: E.

  Returns:
    [L', E] int64: entry [l, e] counts how many of the selected tokens' k slots in layer l went to expert e.
  """
  experts = np.asarray(routed_experts)
  keep = np.asarray(select, bool)[..., None] & (experts >= 0)
  counts = np.zeros((experts.shape[1], n_experts), np.int64)
  layer = np.broadcast_to(np.arange(experts.shape[1])[None, :, None, None], experts.shape)
  np.add.at(counts, (layer[keep], experts[keep]), 1)
  return counts


def shares(counts: np.ndarray) -> np.ndarray:
  """Counts [..., E] -> fractions [..., E] summing to one (all zeros where nothing was counted)."""
  counts = np.asarray(counts, np.float64)
  total = counts.sum(-1, keepdims=True)
  return np.divide(counts, total, out=np.zeros_like(counts), where=total > 0)


def js_divergence(p: np.ndarray, q: np.ndarray) -> np.ndarray:
  """Jensen–Shannon divergence in bits of distributions [..., E] (0 = identical, 1 = disjoint supports)."""
  p, q = np.asarray(p, np.float64), np.asarray(q, np.float64)
  m = 0.5 * (p + q)

  def kl(a, b):
    ratio = np.divide(a, b, out=np.ones_like(a), where=(a > 0) & (b > 0))
    return np.sum(np.where(a > 0, a * np.log2(ratio), 0.0), axis=-1)

  return 0.5 * kl(p, m) + 0.5 * kl(q, m)
