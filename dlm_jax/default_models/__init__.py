"""The embedded default models: tiny converted checkpoints trained on the synthetic arithmetic task.

  tiny-dlm: LLaDA-style masked diffusion model (bidirectional, mask token, SFT objective).
  tiny-arm: autoregressive model of the same size and tokenizer (causal, next-token objective).
  tiny-moe-dlm: LLaDA-MoE-style masked diffusion mixture of experts (8 experts, top-2, each half the dense
    width, so the same active feed-forward size; softmax router without renormalisation, per-head QK norm).
  tiny-uniform-dlm: DiffusionGemma-style uniform-state block diffusion model (causal encoder over the prompt,
    bidirectional self-conditioning decoder over a random-token canvas, sliding and global layers; no mask
    token), trained with the "uniform" objective (`dlm_jax.training.uniform`).

Each directory holds config.json, model.safetensors, tokenizer.json and training.json (how it was
trained). BUILD.md gives the commands that reproduce them. Experiment binaries use these when no
checkpoint is given.
"""

from __future__ import annotations

import os

NAMES = ("tiny-dlm", "tiny-arm", "tiny-moe-dlm", "tiny-uniform-dlm")


def path(name: str) -> str:
  """Directory of the embedded model `name` (one of `NAMES`)."""
  if name not in NAMES:
    raise ValueError(f"Unknown default model {name!r}; choose one of {NAMES}.")
  return os.path.join(os.path.dirname(os.path.abspath(__file__)), name)
