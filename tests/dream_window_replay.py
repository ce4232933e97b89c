"""The official Dream loop of Elastic-Cache's decoding (`_sample` with `get_transfer_index_fast` in
`dream/model/generation_utils_elastic.py` of VILA-Lab/Elastic-Cache, read through its mirror yxu-dev/Elastic-Cache;
our `dream.elastic_cache_options()`, `dlm_jax.sampling.dream_window`), in NumPy at temperature 0, with the model side
left to the caller: the replays of compute policies on that decoding share it (tests/test_policy_elastic_cache_dream.py,
tests/test_policy_dream_window.py), and the peaked tiny Dream weights they run on."""

import jax
import numpy as np


def softmax(x):
  e = np.exp(x - x.max(axis=-1, keepdims=True))
  return e / e.sum(axis=-1, keepdims=True)


def peaked_params(config, init_params):
  """Random weights of `config` (init_params(config, key)) with nonzero q/k/v biases and the LM head scaled by 8
  (confident proposals, so threshold calls decode several positions)."""
  params = init_params(config, jax.random.key(0))
  attn = params["blocks"]["attn"]
  for i, part in enumerate("qkv"):
    attn[part]["bias"] = 0.3 * jax.random.normal(jax.random.key(10 + i), attn[part]["bias"].shape)
  params["lm_head"]["kernel"] = params["lm_head"]["kernel"] * 8.0
  return params


def replay_window(call, prompt, options, mask_id, eos_id, margins):
  """One row through the official loop. call(tokens [S], window_pos [W], masked [M], decoded [D]) -> the window's
  logits [W, V] (the outputs at window_pos − 1): window_pos the first `options.window` still-masked positions,
  masked the still-masked set, decoded the positions the previous call decoded. Every window position whose top
  probability is >= min(options.threshold, the window's largest) takes its argmax; after the first call that
  decodes eos_id the masked set keeps only the positions before the smallest EOS that call decoded; the loop ends
  when the set is empty. margins gets each candidate's distance to the threshold and the gap between the two best.
  -> (tokens [S], decode step per generated position [G] (-1: never), calls made, whether the EOS cut left
  masks)."""
  gen, lp = options.gen_length, len(prompt)
  tokens = np.concatenate([prompt, np.full(gen, mask_id)])
  decode_step, calls, decoded = np.full(gen, -1), 0, np.zeros(0, int)
  masked, decoded_eos, cut = np.arange(lp, lp + gen), False, False
  while len(masked):
    window_pos = masked[:options.window]
    probs = softmax(call(tokens, window_pos, masked, decoded))
    confidence, x0 = probs.max(-1), probs.argmax(-1)
    keep = confidence >= min(options.threshold, confidence.max())
    margins.extend(np.abs(confidence - options.threshold))
    if len(confidence) > 1:
      margins.append(np.diff(np.sort(confidence)[-2:])[0])
    assert not np.any(x0[keep] == mask_id), "the replay covers runs that never decode the mask id"
    decoded = window_pos[keep]
    tokens[decoded] = x0[keep]
    decode_step[decoded - lp] = calls
    calls += 1
    masked = masked[~np.isin(masked, decoded)]
    eos = decoded[x0[keep] == eos_id]
    if not decoded_eos and len(eos):
      decoded_eos, cut = True, bool(np.any(masked > eos.min()))
      masked = masked[masked <= eos.min()]
  return tokens, decode_step, calls, cut
