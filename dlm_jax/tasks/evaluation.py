"""Completions of a converted checkpoint for GSM8K-format questions, in the layout it was trained with.

Prompts are `[PAD … BOS question]`, left-padded to `prompt_len` (the "sft" layout of
`dlm_jax.training.data`). Diffusion models are decoded with LLaDA's `generate` (low-confidence remasking,
temperature 0; pads visible, as in training); causal models greedily with the KV-cache decoder (pads
masked, positions shifted, so the prompt is seen exactly as in training). A checkpoint trained with a
front extra sink token (its training.json says so) gets the sink prepended and the `SinkToken`
intervention. Each completion is cut at the first EOS or PAD and decoded without special tokens.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from dlm_jax.io import prompt_layout
from dlm_jax.sampling.run_setup import RunSetup
from dlm_jax.training import data as training_data


def complete(directory: str, questions: Sequence[str], *, prompt_len: int | None = None, gen_length: int = 32,
             steps: int | None = None, block_length: int | None = None, batch_size: int = 100) -> list[str]:
  """Decoded completions of the checkpoint in `directory` for `questions`.

  prompt_len: prompt width (default: the training record's). A checkpoint whose default layout is not the
  training layout (`dlm_jax.io.prompt_layout`: no training.json with a prompt width) is refused unless
  prompt_len is given: its prompts would be laid out as it never saw them. steps / block_length: diffusion
  sampler settings (default steps = gen_length, one block). The model decodes with its default sampler
  (`dlm_jax.sampling.registry.default_for`); uniform-state models are refused (their prompt layout is the
  binaries').
  """
  # Heavy imports stay local: the task readers must not pull in the samplers.
  from dlm_jax.io import checkpoint  # pylint: disable=import-outside-toplevel
  from dlm_jax.sampling import registry  # pylint: disable=import-outside-toplevel
  from dlm_jax.io.tokenizer import Tokenizer  # pylint: disable=import-outside-toplevel

  record = prompt_layout.training_record(directory)
  prompt_len = prompt_len or prompt_layout.training_prompt_width(record)
  if not prompt_len:
    raise ValueError(f"{directory}: complete() lays prompts out in the training layout, and the checkpoint's default "
                     f"is {prompt_layout.default_layout(directory, record)} (no training.json with a prompt width); "
                     "pass prompt_len to use the training layout anyway.")
  config, params = checkpoint.load(directory, dtype=np.float32)
  tokenizer = Tokenizer.from_dir(directory, config)
  sink = record.get("train_config", {}).get("sink", "none")
  ids = training_data.SpecialIds(pad=config.pad_token_id, bos=config.bos_token_id, eos=config.eos_token_id)
  sampler = registry.default_for(config)
  if sampler.self_conditioning:
    raise ValueError(f"{directory}: complete() decodes masked-diffusion and causal checkpoints; a uniform-state "
                     "(DiffusionGemma-style) model is evaluated by `python -m experiments.evaluate_synthetic`.")
  common = registry.CommonSettings(gen_length=gen_length, steps=steps or gen_length, block_length=block_length)
  completions = []
  for start in range(0, len(questions), batch_size):
    prompt = training_data.left_padded_prompts(questions[start:start + batch_size], tokenizer.encode, ids, prompt_len)
    if sampler.kind == "causal":
      trace = sampler.generate(params, prompt, config=config, options=sampler.options(common, stop_at_eos=True),
                               prompt_mask=prompt != ids.pad)
    else:
      setup = RunSetup()
      if sink != "none":
        from dlm_jax.instrument import interventions  # pylint: disable=import-outside-toplevel
        if sink != "front":
          raise NotImplementedError("Only a front sink token can be evaluated (it sits in the prompt).")
        prompt = np.asarray(interventions.add_sink_token(prompt, tokenizer.token_to_id("[SINK]"), "front"))
        setup = RunSetup(intervention=interventions.SinkToken("front"))
      trace = sampler.generate(params, prompt, config=config, options=sampler.options(common), setup=setup)
    for row in np.asarray(trace.generated).tolist():
      stop = next((i for i, t in enumerate(row) if t in (ids.eos, ids.pad)), len(row))
      completions.append(tokenizer.decode(row[:stop], skip_special_tokens=True))
  return completions
