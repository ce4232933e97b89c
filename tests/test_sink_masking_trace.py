"""Traced runs of sink masking: at every model call the masked keys are the top-K sinks measured at the
previous call, they receive exactly zero attention, and the recorded statistics equal attention
recomputed under that mask (dense forward; NumPy from the params for layer 0)."""

import jax
import jax.numpy as jnp
import numpy as np

from dlm_jax.instrument import interventions as iv
from dlm_jax import model
from dlm_jax.config import preset
from dlm_jax.sampling import autoregressive as ar_sampler
from dlm_jax.sampling import dream, llada
from dlm_jax.sampling.driver import TRACE_COUNTS
from dlm_jax.instrument.stats import StatsSpec, squeeze_incoming
from dlm_jax.model import CallInstruments, Compute
from dlm_jax.sampling.run_setup import RunSetup

jax.config.update("jax_default_matmul_precision", "highest")

B, S, PROMPT, STEPS = 2, 16, 4, 6


def peaky_params(config, seed=0):
  """Random params with sharper attention (scaled q/k), so that sinks stand out."""
  params = model.init_params(config, jax.random.key(seed))
  attn = params["blocks"]["attn"]
  attn["q"]["kernel"] = attn["q"]["kernel"] * 3.0
  attn["k"]["kernel"] = attn["k"]["kernel"] * 3.0
  return params


def step_sequences(trace, mask_id, steps):
  """[steps, B, S] int32: the sequence each step of a diffusion `Trace` saw, rebuilt from decode_step."""
  final, decode_step = np.asarray(trace.tokens), np.asarray(trace.decode_step)
  lp = trace.prompt_length
  out = []
  for t in range(steps):
    sequence = final.copy()
    sequence[:, lp:] = np.where((decode_step >= 0) & (decode_step < t), final[:, lp:], mask_id)
    out.append(sequence)
  return jnp.asarray(np.stack(out), jnp.int32)


def run_llada(config, params, intervention, state, options=None):
  """The real LLaDA sampler with per-head statistics and the intervention's record: (sequences [STEPS, B, S],
  masked [STEPS, ...] (the record), incoming [STEPS, L, B, N, S])."""
  options = options or llada.LLaDAOptions(gen_length=S - PROMPT, steps=STEPS, block_length=(S - PROMPT) // 2)
  prompt = jnp.asarray(np.random.default_rng(0).integers(3, 200, size=(B, PROMPT)), jnp.int32)
  trace = llada.generate(params, prompt, config=config, options=options,
                         setup=RunSetup(intervention=intervention, intervention_state=state,
                                        stats_spec=StatsSpec(incoming_attention=True, per_head=True),
                                        record_intervention=True, attention_impl="chunked", query_chunk=4))
  sequences = step_sequences(trace, config.mask_token_id, options.steps)
  return sequences, np.asarray(trace.intervention_record), np.asarray(trace.stats["incoming_attention"])


def numpy_layer0_qk(config, params, tokens, positions):
  """Layer-0 queries [B, T, N, H] and keys [B, T, N, H] (kv heads repeated) in float64, after RoPE."""
  p = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
  x = p["embed"]["embedding"][np.asarray(tokens)]
  x = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + config.norm_eps) * p["blocks"]["attn_norm"]["weight"][0]
  attn = p["blocks"]["attn"]

  def project(name, heads):
    y = x @ attn[name]["kernel"][0] + (attn[name]["bias"][0] if config.qkv_bias else 0.0)
    return y.reshape(*y.shape[:2], heads, config.head_dim)

  q, k = project("q", config.n_heads), project("k", config.n_kv_heads)
  inv_freq = config.rope_theta ** (-np.arange(0, config.head_dim, 2) / config.head_dim)
  angles = np.asarray(positions, np.float64)[..., None] * inv_freq
  angles = np.concatenate([angles, angles], -1)[:, :, None, :]

  def rope(v):
    half = config.head_dim // 2
    rotated = np.concatenate([-v[..., half:], v[..., :half]], -1)
    return v * np.cos(angles) + rotated * np.sin(angles)

  k = np.repeat(rope(k), config.n_heads // config.n_kv_heads, axis=2)
  return rope(q), k


def numpy_layer0_probs(config, params, tokens, masked, causal=False):
  """Layer-0 attention P [B, N, T, T] with `masked` keys ([B, N, T] or [B, T]) removed."""
  positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
  q, k = numpy_layer0_qk(config, params, tokens, positions)
  scores = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(config.head_dim)
  masked = np.asarray(masked)
  allowed = ~(masked[:, :, None, :] if masked.ndim == 3 else masked[:, None, None, :])
  if causal:
    allowed = allowed & np.tril(np.ones((tokens.shape[1],) * 2, bool))
  scores = np.where(allowed, scores, -np.inf)
  with np.errstate(invalid="ignore"):  # rows left without keys (not compared) become NaN
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    return probs / probs.sum(-1, keepdims=True)


def expected_top_k(incoming, k, eps=None):
  """Brute force over (l, b, n) of incoming [L, B, N, S] (or one score row per b of [B, S])."""
  out = np.zeros(incoming.shape, bool)
  for index in np.ndindex(*incoming.shape[:-1]):
    b = index[1] if incoming.ndim == 4 else index[0]
    c = incoming[index].astype(np.float64)
    for j in sorted(range(c.size), key=lambda j: (-c[j], j))[:k[b]]:
      if eps is None or c[j] > np.delete(c, j).mean() + eps:
        out[index + (j,)] = True
  return out


def check_trace(config, params, tokens_per_step, masked, incoming, k, eps=None, per_head=True, first=None):
  """masked: the intervention's record [steps, L, B, N, S] (or [steps, B, S] global); incoming: the recorded
  statistics [steps, L, B, N, S]."""
  first = np.zeros(masked.shape[1:], bool) if first is None else first
  np.testing.assert_array_equal(masked[0], first)
  spec = iv.MaskPreviousSinks().required_stats(config)
  dense = jax.jit(lambda tokens, bias: squeeze_incoming(model.forward(
      params, tokens, config=config, bias=bias, attention_impl="dense", stats_spec=spec).incoming_attention, spec))
  for t in range(masked.shape[0]):
    if t:  # the masked keys at t are the top-K sinks recorded at t - 1
      scores = incoming[t - 1] if per_head else incoming[t - 1].mean(axis=(0, 2))
      np.testing.assert_array_equal(masked[t], expected_top_k(scores, k, eps), err_msg=f"step {t}")
    full_mask = masked[t] if per_head else np.broadcast_to(masked[t][None, :, None], incoming[t].shape)
    assert np.all(incoming[t][full_mask] == 0.0), t
    np.testing.assert_allclose(incoming[t].sum(-1), S, rtol=1e-5)  # rows renormalised
    recomputed = dense(tokens_per_step[t], iv.key_mask_bias(jnp.asarray(masked[t]), per_layer_head=per_head))
    np.testing.assert_allclose(incoming[t], recomputed, atol=2e-5)
    layer0_mask = masked[t][0] if per_head else masked[t]
    probs = numpy_layer0_probs(config, params, np.asarray(tokens_per_step[t]), layer0_mask)
    np.testing.assert_allclose(incoming[t][0], probs.sum(-2), atol=1e-4)
  return masked


def test_trace_per_head_k_as_data_and_epsilon():
  config = preset("tiny-llada")
  params = peaky_params(config)
  sink_mask = iv.MaskPreviousSinks()
  state = iv.MaskPreviousSinks.with_top_k(sink_mask.init_state(config, B, S), jnp.array([1, 3]))
  tokens, masked, incoming = run_llada(config, params, sink_mask, state)
  masked = check_trace(config, params, tokens, masked, incoming, k=[1, 3])
  assert masked[1:].sum(-1).min() >= 1 and (masked[1:, :, 1].sum(-1) == 3).all()
  # the same compiled program with K = 4 and the ε-rule on (ε is data): fewer than K keys pass somewhere
  traced = TRACE_COUNTS["llada"]
  state_eps = iv.MaskPreviousSinks.with_epsilon(iv.MaskPreviousSinks.with_top_k(state, 4), 0.5)
  tokens, masked, incoming = run_llada(config, params, sink_mask, state_eps)
  masked = check_trace(config, params, tokens, masked, incoming, k=[4, 4], eps=0.5)
  counts = masked[1:].sum(-1)
  assert counts.max() <= 4 and counts.min() < 4
  assert TRACE_COUNTS["llada"] == traced


def test_trace_global_gqa_with_first_step_mask():
  """Dream's sampler (GQA, q/k/v bias) with global masks and the first key masked at the first step."""
  config = preset("tiny-dream")
  params = peaky_params(config, seed=1)
  sink_mask = iv.MaskPreviousSinks(top_k=2, per_head=False, initial_keys=(0,))
  prompt = jnp.asarray(np.random.default_rng(1).integers(3, 200, size=(B, PROMPT)), jnp.int32)
  options = dream.DreamOptions(gen_length=S - PROMPT, steps=STEPS, alg="maskgit_plus")
  trace = dream.diffusion_generate(params, prompt, config=config, options=options,
                                   setup=RunSetup(intervention=sink_mask,
                                                  stats_spec=StatsSpec(incoming_attention=True, per_head=True),
                                                  record_intervention=True, query_chunk=4))
  tokens = step_sequences(trace, config.mask_token_id, STEPS)
  first = np.zeros((B, S), bool)
  first[:, 0] = True
  check_trace(config, params, tokens, np.asarray(trace.intervention_record),
              np.asarray(trace.stats["incoming_attention"]), k=[2, 2], per_head=False, first=first)


def test_trace_autoregressive_last_row_with_kv_cache():
  """The AR sampler (prefill, then T = 1 KV-cache calls) with last-row weights: the keys masked at call i (its
  record) are the top-K of call i−1's last query row, and every row is an exact softmax under its mask."""
  config = preset("tiny-llama")  # causal, GQA
  params = peaky_params(config, seed=2)
  ar = iv.MaskPreviousSinksAR(top_k=2, last_row_weights=True)
  prompt_len, new_tokens = 5, 5
  prompt = jnp.asarray(np.random.default_rng(0).integers(3, 200, size=(B, prompt_len)), jnp.int32)
  trace = ar_sampler.generate(params, prompt, config=config, options=ar_sampler.AROptions(gen_length=new_tokens),
                              setup=RunSetup(stats_spec=StatsSpec(incoming_attention=True, per_head=True),
                                             intervention=ar, record_intervention=True))
  sequence, masks = np.asarray(trace.tokens), np.asarray(trace.intervention_record)  # masks [steps, L, B, N, S]
  incoming = np.asarray(trace.stats["incoming_attention"])  # [steps, L, B, N, S]
  # the prefill's last row, recomputed densely (one call: exact in every layer); later calls feed one query,
  # so their recorded statistics are their last row
  weights = jnp.asarray(np.eye(prompt_len)[None, -1:].repeat(B, 0), jnp.float32)
  row_spec = StatsSpec(incoming_attention=True, per_head=True, query_groups=1)
  prefill = model.forward(params, prompt, config=config, compute=Compute(attention_impl="dense"),
                          instruments=CallInstruments(query_weights=weights, stats_spec=row_spec))
  prefill_row = np.asarray(squeeze_incoming(prefill.incoming_attention, row_spec))[:, :, 0]
  rows = [np.pad(prefill_row, [(0, 0)] * 3 + [(0, new_tokens)])] + list(incoming[1:])
  assert not masks[0].any()
  for i in range(new_tokens):
    length = prompt_len + i  # keys written by call i
    if i:
      np.testing.assert_array_equal(masks[i], expected_top_k(rows[i - 1], [2, 2]), err_msg=f"call {i}")
      assert masks[i][..., :length].any()
    row = rows[i]
    assert np.all(row[masks[i]] == 0.0) and np.all(row[..., length:] == 0.0)
    np.testing.assert_allclose(row.sum(-1), 1.0, rtol=1e-5)
    probs = numpy_layer0_probs(config, params, sequence[:, :length], masks[i][0][..., :length], causal=True)
    np.testing.assert_allclose(row[0][..., :length], probs[:, :, -1], atol=1e-4)


def test_autoregressive_sampler_trace_masks_previous_last_row_sinks():
  """`dlm_jax.sampling.autoregressive.generate` with MaskPreviousSinksAR (default, no query weights): each decode
  step (T = 1) records its last row; the keys it masks are the top-K of the previous step's statistics
  (the prefill's column sums for the first decode step)."""
  config = preset("tiny-llama")
  params = peaky_params(config, seed=4)
  prompt = jnp.asarray(np.random.default_rng(4).integers(3, 200, size=(B, 5)), jnp.int32)
  trace = ar_sampler.generate(params, prompt, config=config, options=ar_sampler.AROptions(gen_length=5),
                              setup=RunSetup(stats_spec=StatsSpec(incoming_attention=True, per_head=True),
                                             intervention=iv.MaskPreviousSinksAR(top_k=2)))
  incoming = np.asarray(trace.stats["incoming_attention"])  # [steps, L, B, N, S]
  for i in range(1, incoming.shape[0]):
    masked = expected_top_k(incoming[i - 1], [2, 2])
    assert np.all(incoming[i][masked] == 0.0), i
    np.testing.assert_allclose(incoming[i].sum(-1), 1.0, rtol=1e-5)  # one query row, renormalised
