"""Ceilings on the sizes a session takes from its settings (the binaries' flags), checked before anything is
allocated.

`--gen_length=10**9` must be a one-line error, not an allocation that runs for minutes. Two rules:

* a hard ceiling per flag (`CEILINGS`), far above any real use: sequences of at most `MAX_SEQUENCE`
  positions, at most `MAX_STEPS` denoising steps, `MAX_BATCH` rows per sampler call, `MAX_ITEMS` items;
* relative to the model (`check_sequence`): the prompt plus the generated positions at most `MAX_SEQUENCE`,
  and the float32 logits of one sampler call (batch × sequence × vocabulary) at most `MAX_LOGITS`
  elements (64 GiB), the largest array a decoding step makes.
"""

from __future__ import annotations

from dlm_jax.session.errors import SessionError

MAX_SEQUENCE = 131072
MAX_STEPS = 131072
MAX_BATCH = 4096
MAX_ITEMS = 1_000_000
MAX_LOGITS = 2**34
CEILINGS = {"gen_length": MAX_SEQUENCE, "block_length": MAX_SEQUENCE, "seq_len": MAX_SEQUENCE,
            "prompt_len": MAX_SEQUENCE, "query_chunk": MAX_SEQUENCE, "mask_sinks": MAX_SEQUENCE,
            "steps": MAX_STEPS, "max_post_steps": MAX_STEPS, "stability_threshold": MAX_STEPS,
            "top_k": 2**24, "lens_top_k": 2**24, "batch_size": MAX_BATCH, "train_batch_size": MAX_BATCH,
            "cpu_devices": MAX_BATCH,
            "n": MAX_ITEMS, "n_items": MAX_ITEMS, "n_prompts": MAX_ITEMS, "n_eval": MAX_ITEMS,
            "perplexity_items": MAX_ITEMS, "eval_size": MAX_ITEMS, "train_size": 100 * MAX_ITEMS,
            "top_tokens": MAX_ITEMS, "samples_per_item": 10 * MAX_ITEMS, "max_points": 10 * MAX_ITEMS}
"""The largest value each size flag accepts."""


def check(**values: int | None) -> None:
  """Raises SessionError naming the first flag whose value is above its ceiling (None: unset, accepted)."""
  for name, value in values.items():
    limit = CEILINGS[name]
    if value is not None and value > limit:
      raise SessionError(f"--{name}={value}: above the limit {limit}; nothing was allocated")


def check_sequence(prompt_length: int, gen_length: int, vocab_size: int, batch: int = 1) -> None:
  """Refuses a sampler call whose sequence or logits would be larger than the ceilings (module docstring)."""
  length = prompt_length + gen_length
  if length > MAX_SEQUENCE:
    raise SessionError(f"prompt ({prompt_length}) + --gen_length ({gen_length}) = {length} positions, above the "
                       f"limit {MAX_SEQUENCE}; nothing was allocated")
  if batch * length * vocab_size > MAX_LOGITS:
    raise SessionError(f"{batch} × {length} positions × vocabulary {vocab_size} logits is above the limit of "
                       f"{MAX_LOGITS} ({MAX_LOGITS * 4 // 2**30} GiB of float32); use a smaller --gen_length or batch")
