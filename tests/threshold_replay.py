"""Fast-dLLM's threshold rule written in NumPy for the tests' whole-run replays (the policy files replay a sampler
call by call and commit with it): at a call, the best still-masked candidate of the block and every other whose
softmax confidence reaches τ are committed with their argmax, ties broken by the lowest position."""

import numpy as np


def threshold_commits(logits: np.ndarray, tau: float, margins: list) -> tuple[list[int], np.ndarray]:
  """(chosen, x0) for the candidates' logits [n, V] (n >= 1): chosen, indices into the candidates, best first;
  x0 [n] their argmax tokens. Appends to `margins` each confidence's distance to τ and the gap between the best
  two, so a test can check that the float32 run is far from every decision boundary the float64 replay met."""
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  x0, conf = probs.argmax(-1), probs.max(-1)
  order = sorted(range(len(conf)), key=lambda j: (-conf[j], j))
  chosen = order[:1] + [j for j in order[1:] if conf[j] >= tau]
  margins.extend(np.abs(conf - tau))
  if len(order) > 1:
    margins.append(conf[order[0]] - conf[order[1]])
  return chosen, x0
