"""Traced runs of sink masking: at every model call the masked keys are the top-K sinks measured at the
previous call, they receive exactly zero attention, and the recorded statistics equal attention
recomputed under that mask (dense forward; NumPy from the params for layer 0)."""

import jax
import jax.numpy as jnp
import numpy as np

from dlm_jax import interventions as iv
from dlm_jax import model
from dlm_jax.config import preset
from dlm_jax.sampling import autoregressive as ar_sampler
from dlm_jax.sampling import llada

jax.config.update("jax_default_matmul_precision", "highest")

B, S, PROMPT, STEPS = 2, 16, 4, 6


def peaky_params(config, seed=0):
  """Random params with sharper attention (scaled q/k), so that sinks stand out."""
  params = model.init_params(config, jax.random.key(seed))
  attn = params["blocks"]["attn"]
  attn["q"]["kernel"] = attn["q"]["kernel"] * 3.0
  attn["k"]["kernel"] = attn["k"]["kernel"] * 3.0
  return params


def canvases(config, seed=0):
  """[STEPS, B, S] int32: a prompt then mask tokens; two masked positions get a token after every step."""
  rng = np.random.default_rng(seed)
  canvas = np.full((B, S), config.mask_token_id)
  canvas[:, :PROMPT] = rng.integers(3, 200, size=(B, PROMPT))
  out = []
  for _ in range(STEPS):
    out.append(canvas.copy())
    for b in range(B):
      masked = np.flatnonzero(canvas[b] == config.mask_token_id)
      canvas[b, rng.choice(masked, 2, replace=False)] = rng.integers(3, 200, size=2)
  return jnp.asarray(np.stack(out), jnp.int32)


def run_loop(config, intervention):
  """A jitted lax.scan over steps: bias -> forward (with the intervention's stats) -> update."""
  spec = intervention.required_stats(config)

  @jax.jit
  def run(params, state, tokens_per_step):
    def body(state, xs):
      step, tokens = xs
      context = iv.CallContext(step=step, tokens=tokens)
      bias = intervention.bias(state, context)
      output = model.forward(params, tokens, config=config, stats_spec=spec, attention_impl="chunked",
                             query_chunk=4, **bias.forward_kwargs())
      record = {"masked": state.masked, "incoming": output.incoming_attention, "key_bias": bias.keys}
      return intervention.update(state, output, context), record

    return jax.lax.scan(body, state, (jnp.arange(tokens_per_step.shape[0], dtype=jnp.int32), tokens_per_step))[1]

  return run


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


def check_trace(config, params, tokens_per_step, record, k, eps=None, per_head=True, first=None):
  masked = np.asarray(record["masked"])
  incoming = np.asarray(record["incoming"])  # [steps, L, B, N, S]
  first = np.zeros(masked.shape[1:], bool) if first is None else first
  np.testing.assert_array_equal(masked[0], first)
  dense = jax.jit(lambda tokens, key_bias: model.forward(
      params, tokens, config=config, key_bias=key_bias, attention_impl="dense",
      stats_spec=iv.MaskPreviousSinks().required_stats(config)).incoming_attention)
  for t in range(STEPS):
    if t:  # the masked keys at t are the top-K sinks recorded at t - 1
      scores = incoming[t - 1] if per_head else incoming[t - 1].mean(axis=(0, 2))
      np.testing.assert_array_equal(masked[t], expected_top_k(scores, k, eps), err_msg=f"step {t}")
    full_mask = masked[t] if per_head else np.broadcast_to(masked[t][None, :, None], incoming[t].shape)
    assert np.all(incoming[t][full_mask] == 0.0), t
    np.testing.assert_allclose(incoming[t].sum(-1), S, rtol=1e-5)  # rows renormalised
    recomputed = dense(tokens_per_step[t], record["key_bias"][t])
    np.testing.assert_allclose(incoming[t], recomputed, atol=2e-5)
    layer0_mask = masked[t][0] if per_head else masked[t]
    probs = numpy_layer0_probs(config, params, np.asarray(tokens_per_step[t]), layer0_mask)
    np.testing.assert_allclose(incoming[t][0], probs.sum(-2), atol=1e-4)
  return masked


def test_trace_per_head_k_as_data_and_epsilon():
  config = preset("tiny-llada")
  params = peaky_params(config)
  tokens = canvases(config)
  sink_mask = iv.MaskPreviousSinks()
  run = run_loop(config, sink_mask)
  state = iv.MaskPreviousSinks.with_top_k(sink_mask.init_state(config, B, S), jnp.array([1, 3]))
  masked = check_trace(config, params, tokens, run(params, state, tokens), k=[1, 3])
  assert masked[1:].sum(-1).min() >= 1 and (masked[1:, :, 1].sum(-1) == 3).all()
  # the same compiled program with K = 4 and the ε-rule on (ε is data): fewer than K keys pass somewhere
  state_eps = iv.MaskPreviousSinks.with_epsilon(iv.MaskPreviousSinks.with_top_k(state, 4), 0.5)
  masked = check_trace(config, params, tokens, run(params, state_eps, tokens), k=[4, 4], eps=0.5)
  counts = masked[1:].sum(-1)
  assert counts.max() <= 4 and counts.min() < 4
  assert run._cache_size() == 1


def test_trace_global_gqa_with_first_step_mask():
  config = preset("tiny-dream")  # GQA, q/k/v bias
  params = peaky_params(config, seed=1)
  tokens = canvases(config, seed=1)
  sink_mask = iv.MaskPreviousSinks(top_k=2, per_head=False, initial_keys=(0,))
  record = jax.jit(run_loop(config, sink_mask))(params, sink_mask.init_state(config, B, S), tokens)
  first = np.zeros((B, S), bool)
  first[:, 0] = True
  check_trace(config, params, tokens, record, k=[2, 2], per_head=False, first=first)


def test_trace_autoregressive_last_row_with_kv_cache():
  """Prefill then T = 1 decode calls: the keys masked at call i are the top-K of call i−1's last row."""
  config = preset("tiny-llama")  # causal, GQA
  params = peaky_params(config, seed=2)
  ar = iv.MaskPreviousSinksAR(top_k=2, last_row_weights=True)
  spec = ar.required_stats(config)
  cache_len, prompt_len, new_tokens = 12, 5, 5

  @jax.jit
  def call(state, canvas, tokens, cache, offset):
    context = iv.CallContext(step=offset, tokens=canvas, query_offset=offset, query_length=tokens.shape[1])
    output, cache = model.forward_cached(params, tokens, cache, offset, config=config, stats_spec=spec,
                                         query_weights=ar.query_weights(state, context),
                                         **ar.bias(state, context).forward_kwargs())
    return ar.update(state, output, context), output, cache

  rng = np.random.default_rng(0)
  sequence = rng.integers(3, 200, size=(B, prompt_len))
  state = ar.init_state(config, B, cache_len)
  cache = model.KVCache.zeros(config, B, cache_len)
  masks, rows, lengths = [], [], []
  tokens, offset = jnp.asarray(sequence, jnp.int32), 0
  for _ in range(new_tokens):
    masks.append(np.asarray(state.masked))
    canvas = jnp.zeros((B, cache_len), jnp.int32).at[:, :sequence.shape[1]].set(jnp.asarray(sequence))
    state, output, cache = call(state, canvas, tokens, cache, jnp.int32(offset))
    rows.append(np.asarray(output.incoming_attention)[:, :, 0])  # [L, B, N, S]: the last row
    offset += tokens.shape[1]
    lengths.append(offset)
    next_token = np.asarray(jnp.argmax(output.logits[:, -1], -1))[:, None]
    sequence = np.concatenate([sequence, next_token], 1)
    tokens = jnp.asarray(next_token, jnp.int32)

  assert not masks[0].any()
  for i, (masked, row, length) in enumerate(zip(masks, rows, lengths)):
    if i:
      np.testing.assert_array_equal(masked, expected_top_k(rows[i - 1], [2, 2]), err_msg=f"call {i}")
      assert masked[..., :length].any()
    assert np.all(row[masked] == 0.0) and np.all(row[..., length:] == 0.0)
    np.testing.assert_allclose(row.sum(-1), 1.0, rtol=1e-5)
    probs = numpy_layer0_probs(config, params, sequence[:, :length], masked[0][..., :length], causal=True)
    np.testing.assert_allclose(row[0][..., :length], probs[:, :, -1], atol=1e-4)


def test_llada_sampler_trace_masks_previous_sinks():
  """`dlm_jax.sampling.llada.generate` with MaskPreviousSinks, replayed step by step from its Trace: the
  canvas of step t is rebuilt from decode_step, the mask from the top-K of the statistics of step t−1, and
  the statistics of step t are recomputed under that mask."""
  from dlm_jax.stats import StatsSpec
  config = preset("tiny-llada")
  params = peaky_params(config, seed=3)
  options = llada.LLaDAOptions(gen_length=8, steps=8, block_length=4)
  prompt = jnp.asarray(np.random.default_rng(3).integers(3, 200, size=(B, PROMPT)), jnp.int32)
  sink_mask = iv.MaskPreviousSinks()
  state = iv.MaskPreviousSinks.with_top_k(sink_mask.init_state(config, B, PROMPT + 8), jnp.array([2, 1]))
  spec = StatsSpec(incoming_attention=True, per_head=True)
  trace = llada.generate(params, prompt, config=config, options=options, stats_spec=spec,
                         intervention=sink_mask, intervention_state=state)
  incoming = np.asarray(trace.stats["incoming_attention"])  # [steps, L, B, N, S]
  final, decode_step = np.asarray(trace.tokens), np.asarray(trace.decode_step)
  dense = jax.jit(lambda tokens, key_bias: model.forward(
      params, tokens, config=config, key_bias=key_bias, attention_impl="dense", stats_spec=spec).incoming_attention)
  for t in range(options.steps):
    canvas = final.copy()
    canvas[:, PROMPT:] = np.where((decode_step >= 0) & (decode_step < t), final[:, PROMPT:], config.mask_token_id)
    masked = np.zeros(incoming.shape[1:], bool) if t == 0 else expected_top_k(incoming[t - 1], [2, 1])
    assert np.all(incoming[t][masked] == 0.0), t
    key_bias = jnp.asarray(np.where(masked, np.float32(iv.MASK_VALUE), np.float32(0.0)))
    np.testing.assert_allclose(incoming[t], dense(jnp.asarray(canvas, jnp.int32), key_bias), atol=2e-5,
                               err_msg=f"step {t}")


def test_autoregressive_sampler_trace_masks_previous_last_row_sinks():
  """`dlm_jax.sampling.autoregressive.generate` with MaskPreviousSinksAR (default, no query weights): each decode
  step (T = 1) records its last row; the keys it masks are the top-K of the previous step's statistics
  (the prefill's column sums for the first decode step)."""
  from dlm_jax.stats import StatsSpec
  config = preset("tiny-llama")
  params = peaky_params(config, seed=4)
  prompt = jnp.asarray(np.random.default_rng(4).integers(3, 200, size=(B, 5)), jnp.int32)
  trace = ar_sampler.generate(params, prompt, config=config, options=ar_sampler.AROptions(gen_length=5),
                              stats_spec=StatsSpec(incoming_attention=True, per_head=True),
                              intervention=iv.MaskPreviousSinksAR(top_k=2))
  incoming = np.asarray(trace.stats["incoming_attention"])  # [steps, L, B, N, S]
  for i in range(1, incoming.shape[0]):
    masked = expected_top_k(incoming[i - 1], [2, 2])
    assert np.all(incoming[i][masked] == 0.0), i
    np.testing.assert_allclose(incoming[i].sum(-1), 1.0, rtol=1e-5)  # one query row, renormalised
