"""What `ModelConfig.logit_shift` means: which model output predicts which token, the one rule every reader of
logits follows (the Dream sampler, the likelihood estimators, the training objectives).

With shift s, the output at position i predicts the token at i + s: LLaDA-style models (s = 0) predict each
position from its own output; Dream and the autoregressive models (s = 1) predict position i from the output
at i − 1 (`reference/models.md` §1, §3.6). So the logits of target positions [start, stop) are the outputs of
positions [start − s, stop − s).

Targets before position s have no output to read. Dream's code (`diffusion_generate`, `eval/eval.py`, and
dllm's Dream trainer alike) builds `logits'[:, 0] = logits[:, 0]`: the first target repeats the output at
position 0. `target_logits` does the same. None of our callers scores such a row: training never masks
position 0 of a shifted model, Dream's likelihood never masks the first position, and the Dream sampler
reads it only when an infill prompt holds a mask at position 0 — where it predicts exactly as Dream's code.
(The training objective used zeros for that row before this rule was shared; the row is never scored, so
the loss, its metrics and its gradient are the same bit for bit — `tests/test_logit_shift.py`.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def output_window(start: int, stop: int, shift: int) -> tuple[int, int]:
  """The output positions [a, b) whose logits predict target positions [start, stop) (0 <= start < stop):
  (max(start − shift, 0), stop − shift)."""
  return max(start - shift, 0), stop - shift


def target_logits(outputs: jax.Array, start: int, shift: int) -> jax.Array:
  """Logits aligned with their targets: row p predicts the token at start + p.

  outputs: [B, W, V], the model outputs of `output_window(start, stop, shift)`.
  Returns [B, stop − start, V]: the outputs, preceded (when start < shift) by shift − start copies of the
  output at position 0 for the targets that have no output of their own (module docstring).
  """
  missing = max(shift - start, 0)
  if not missing:
    return outputs
  return jnp.concatenate([outputs[:, :1]] * missing + [outputs], axis=1)
