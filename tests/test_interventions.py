"""Attention-bias interventions: exact zeros for masked keys, the sink-token pattern, padding, no NaN under
any combination, the previous-step sink selection and the AR last-row variant."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlm_jax.instrument import interventions as iv
from dlm_jax.sampling.call_plan import intervened_forward
from dlm_jax import model
from dlm_jax.model.attention import MASK_VALUE, attention
from dlm_jax.config import preset
from dlm_jax.instrument.stats import NO_STATS, ForwardOutput, StatsSpec, merge_specs, squeeze_incoming

jax.config.update("jax_default_matmul_precision", "highest")

B, T, N, H = 2, 9, 4, 8


def qkv(seed=0, t=T, s=T, kv=2):
  keys = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(keys[0], (B, t, N, H))
  k = jax.random.normal(keys[1], (B, s, kv, H))
  v = jax.random.normal(keys[2], (B, s, kv, H))
  return q, k, v


def full_probs(q, k, v, bias: iv.AttentionBias, impl="dense", query_offset=0, causal=False):
  """The whole map P [B, N, T, S] via one query group per query (incoming with identity weights)."""
  t = q.shape[1]
  weights = jnp.broadcast_to(jnp.eye(t), (q.shape[0], t, t))
  out, incoming = attention(q, k, v, scale=H ** -0.5, pairwise_bias=bias.pairwise, key_bias=bias.keys,
                            query_weights=weights, with_incoming=True, impl=impl, query_chunk=4,
                            query_offset=query_offset, causal=causal)
  return np.asarray(incoming).transpose(0, 2, 1, 3), np.asarray(out)


def numpy_probs(q, k, allowed):
  """Softmax over the allowed keys only (allowed: bool broadcastable to [B, N, T, S]); GQA by repetition."""
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  k = np.repeat(k, q.shape[2] // k.shape[2], axis=2)
  scores = np.einsum("btnh,bsnh->bnts", q, k) * H ** -0.5
  scores = np.where(allowed, scores, -np.inf)
  p = np.exp(scores - scores.max(-1, keepdims=True))
  return p / p.sum(-1, keepdims=True)


@pytest.mark.parametrize("impl", ["dense", "chunked"])
@pytest.mark.parametrize("per_layer_head", [False, True])
def test_masked_keys_get_exactly_zero_and_rows_renormalise(impl, per_layer_head):
  q, k, v = qkv()
  rng = np.random.default_rng(0)
  masked = rng.random((B, N, T) if per_layer_head else (B, T)) < 0.3
  masked[..., 0] = False  # keep a visible key in every row
  bias = iv.key_mask_bias(jnp.asarray(masked[None] if per_layer_head else masked), per_layer_head=per_layer_head)
  if per_layer_head:
    bias = bias.replace(keys=bias.keys[0])  # one layer: [B, N, S]
  probs, _ = full_probs(q, k, v, bias, impl)
  allowed = ~(masked[:, :, None, :] if per_layer_head else masked[:, None, None, :])
  assert np.all(probs[np.broadcast_to(~allowed, probs.shape)] == 0.0)
  np.testing.assert_allclose(probs.sum(-1), 1.0, atol=1e-6)
  np.testing.assert_allclose(probs, numpy_probs(q, k, allowed), atol=1e-6)


def test_spare_self_keeps_own_key():
  q, k, v = qkv(1)
  masked = np.zeros((B, T), bool)
  masked[:, [2, 5]] = True
  probs, _ = full_probs(q, k, v, iv.spare_self_bias(jnp.asarray(masked), jnp.arange(T)))
  allowed = ~masked[:, None, None, :] | np.eye(T, dtype=bool)[None, None]
  np.testing.assert_allclose(probs, numpy_probs(q, k, allowed), atol=1e-6)
  assert np.all(probs[:, :, 2, 2] > 0) and np.all(probs[:, :, 3, 2] == 0)


@pytest.mark.parametrize("position", ["front", "end"])
def test_sink_token_row_attends_only_to_itself_and_others_see_it(position):
  q, k, v = qkv(2)
  sink_token = iv.SinkToken(position=position)
  config = preset("tiny-llada")
  state = sink_token.init_state(config, B, T)
  context = iv.CallContext(step=jnp.int32(0), tokens=jnp.zeros((B, T), jnp.int32))
  probs, out = full_probs(q, k, v, sink_token.bias(state, context))
  index = 0 if position == "front" else T - 1
  expected_row = np.zeros(T)
  expected_row[index] = 1.0
  np.testing.assert_array_equal(probs[:, :, index], np.broadcast_to(expected_row, probs[:, :, index].shape))
  others = [t for t in range(T) if t != index]
  unbiased = numpy_probs(q, k, np.ones((1, 1, T, T), bool))
  np.testing.assert_allclose(probs[:, :, others], unbiased[:, :, others], atol=1e-6)
  assert np.all(probs[:, :, others, index] > 0)
  # the sink's output is its own value vector
  np.testing.assert_allclose(out[:, index], np.repeat(np.asarray(v)[:, index], N // 2, axis=1), atol=1e-6)


def test_sink_token_bias_with_kv_cache_offset():
  """Cached call: queries are rows query_offset.. of the canvas; only the sink row is restricted."""
  is_sink = jnp.zeros((1, 6), bool).at[:, 3].set(True)
  context = iv.CallContext(jnp.int32(0), jnp.zeros((1, 6), jnp.int32), query_offset=2, query_length=3)
  bias = iv.SinkToken().bias(is_sink, context)
  expected = np.zeros((1, 1, 3, 6), np.float32)
  expected[0, 0, 1, [0, 1, 2, 4, 5]] = MASK_VALUE
  np.testing.assert_array_equal(np.asarray(bias.pairwise), expected)


def test_add_and_remove_sink_token():
  tokens = jnp.arange(6).reshape(2, 3)
  front = iv.add_sink_token(tokens, 99, "front")
  end = iv.add_sink_token(tokens, 99, "end")
  np.testing.assert_array_equal(front[:, 0], 99)
  np.testing.assert_array_equal(end[:, -1], 99)
  np.testing.assert_array_equal(iv.remove_sink_token(front, "front"), tokens)
  np.testing.assert_array_equal(iv.remove_sink_token(end, "end"), tokens)


def test_zero_value_sink_passes_zero_values_to_the_forward():
  sink = iv.SinkToken(zero_value=True)
  bias = sink.bias(sink.init_state(preset("tiny-llada"), 1, 4), iv.CallContext(jnp.int32(0), jnp.zeros((1, 4))))
  np.testing.assert_array_equal(bias.zero_values, [[True, False, False, False]])


@pytest.mark.parametrize("outer", [False, True])
def test_padding(outer):
  q, k, v = qkv(3)
  valid = np.ones((B, T), bool)
  valid[0, :3] = False  # left padding
  valid[1, -2:] = False  # right padding
  probs, out = full_probs(q, k, v, iv.padding_bias(jnp.asarray(valid), outer))
  assert np.all(np.isfinite(probs)) and np.all(np.isfinite(out))
  assert np.all(probs[np.broadcast_to(~valid[:, None, None, :], probs.shape) & np.broadcast_to(
      valid[:, None, :, None], probs.shape)] == 0.0)
  real = numpy_probs(q, k, valid[:, None, None, :])
  rows = np.broadcast_to(valid[:, None, :, None], probs.shape)
  np.testing.assert_allclose(probs[rows], real[rows], atol=1e-6)
  if outer:  # padded queries see nothing: a finite uniform row
    np.testing.assert_allclose(probs[0, :, 0], 1.0 / T, atol=1e-6)


def test_key_padding_from_pad_token():
  config = preset("tiny-llada")
  pad = iv.KeyPadding(pad_token_id=1)
  tokens = jnp.array([[1, 1, 5, 6], [5, 6, 7, 1]])
  bias = pad.bias(pad.init_state(config, 2, 4), iv.CallContext(jnp.int32(0), tokens))
  np.testing.assert_array_equal(np.asarray(bias.keys[:, 0] == np.float32(MASK_VALUE)), np.asarray(tokens == 1))


def test_mask_keys_with_positions_and_shapes():
  config = preset("tiny-llada")
  for per_layer_head in (False, True):
    mask_keys = iv.MaskKeys(per_layer_head=per_layer_head)
    state = mask_keys.init_state(config, 2, 5)
    state = iv.MaskKeys.with_positions(state, jnp.array([[0, 3], [-1, 4]]))
    expected = np.zeros((2, 5), bool)
    expected[0, [0, 3]] = expected[1, 4] = True
    got = np.asarray(state if not per_layer_head else state[1, :, 2])
    np.testing.assert_array_equal(got, expected)
    bias = mask_keys.bias(state, iv.CallContext(jnp.int32(0), jnp.zeros((2, 5), jnp.int32)))
    assert bias.keys.shape == ((config.n_layers, 2, config.n_heads, 5) if per_layer_head else (2, 1, 5))


def test_bias_sums_clamp_and_stay_finite():
  a = iv.AttentionBias(keys=jnp.full((1, 1, 3), MASK_VALUE), zero_values=jnp.array([[True, False, False]]))
  b = iv.AttentionBias(keys=jnp.full((2, 1, 1, 3), MASK_VALUE), zero_values=jnp.array([[False, True, False]]),
                       keys_per_layer=True)
  total = a + b
  assert total.keys.shape == (2, 1, 1, 3) and np.all(np.asarray(total.keys) == np.float32(MASK_VALUE))
  assert total.keys_per_layer and not total.pairwise_per_layer
  np.testing.assert_array_equal(total.zero_values, [[True, True, False]])


def tiny_params(config_name="tiny-llada", seed=0):
  config = preset(config_name)
  return config, model.init_params(config, jax.random.key(seed))


def test_no_nan_under_any_combination_of_masks():
  """One compiled program; every condition is data: all / some / no keys masked, padding, the sink token,
  previous sinks with K = 0 or K = S, on a tiny model, through the plain forward."""
  config, params = tiny_params()
  s = 8
  combined = iv.Compose((iv.MaskKeys(spare_self=True), iv.MaskKeys(per_layer_head=True), iv.KeyPadding(outer=True),
                         iv.SinkToken(), iv.MaskPreviousSinks(initial_keys=(0, -1))))
  tokens = jax.random.randint(jax.random.key(1), (B, s), 0, config.vocab_size)

  @jax.jit
  def run(state):
    output, new_state = intervened_forward(params, tokens, combined, state, config=config,
                                              stats_spec=StatsSpec(incoming_attention=True, value_norms=True))
    output2, _ = intervened_forward(params, tokens, combined, new_state, config=config)
    return output, output2, new_state

  base = combined.init_state(config, B, s)
  options = [
      [base[0], jnp.ones_like(base[0])],  # spare-self masks: none / all keys
      [base[1], jnp.ones_like(base[1])],  # per-(layer, head) masks: none / all keys
      [base[2], base[2].at[0, :3].set(False), jnp.zeros_like(base[2])],  # padding: none / some / everything
      [jnp.zeros_like(base[3]), base[3]],  # sink token off / on
      [iv.MaskPreviousSinks.with_top_k(base[4], 0), iv.MaskPreviousSinks.with_top_k(base[4], s)],
  ]
  for state in itertools.product(*options):
    output, output2, new_state = run(tuple(state))
    for leaf in jax.tree.leaves((output, output2)):
      assert np.all(np.isfinite(np.asarray(leaf))), state
    assert new_state[4].masked.dtype == bool
  assert run._cache_size() == 1


def brute_top_k_masks(incoming, k, eps=None, eligible=None):
  """Per (l, b, n) loop: the k largest keys (ties: lower index), eligible only, optionally ε-rule passing."""
  out = np.zeros(incoming.shape, bool)
  for l, b, n in np.ndindex(*incoming.shape[:3]):
    c = incoming[l, b, n].astype(np.float64)
    keys = [j for j in range(c.size) if eligible is None or eligible[b, j]]
    for j in sorted(keys, key=lambda j: (-c[j], j))[:k[b]]:
      others = np.delete(c, j)
      if eps is None or c[j] > others.mean() + eps:
        out[l, b, n, j] = True
  return out


def random_incoming(rng, config, batch, s):
  logits = rng.normal(size=(config.n_layers, batch, config.n_heads, s, s)) * 2
  p = np.exp(logits - logits.max(-1, keepdims=True))
  return (p / p.sum(-1, keepdims=True)).sum(-2).astype(np.float32)


def test_mask_previous_sinks_update_per_head_global_epsilon_eligible():
  config = preset("tiny-llada")
  rng = np.random.default_rng(0)
  s = 12
  incoming = random_incoming(rng, config, B, s)
  incoming[0, 0, 0, 4] = incoming[0, 0, 0, 9] = incoming[0, 0, 0].max() + 1  # a tie at the top
  output = ForwardOutput(logits=jnp.zeros((B, s, 1)), stats={"incoming_attention": jnp.asarray(incoming)[:, :, None]})  # Q = 1
  context = iv.CallContext(jnp.int32(0), jnp.zeros((B, s), jnp.int32))
  sink_mask = iv.MaskPreviousSinks()
  update = jax.jit(sink_mask.update)
  state = sink_mask.init_state(config, B, s)
  assert not np.asarray(state.masked).any()
  for k in ([1, 1], [5, 2], [0, 10], [s, 3]):
    new = update(iv.MaskPreviousSinks.with_top_k(state, jnp.array(k)), output, context)
    np.testing.assert_array_equal(np.asarray(new.masked), brute_top_k_masks(incoming, k))
  assert update._cache_size() == 1  # K is data
  assert np.asarray(update(state, output, context).masked)[0, 0, 0, 4]  # tie -> lower index
  # eligible keys and the ε-rule
  eligible = rng.random((B, s)) > 0.4
  state_e = iv.MaskPreviousSinks.with_epsilon(state.replace(eligible=jnp.asarray(eligible)), 0.5)
  new = update(iv.MaskPreviousSinks.with_top_k(state_e, 3), output, context)
  expected = brute_top_k_masks(incoming, [3, 3], eps=0.5, eligible=eligible)
  np.testing.assert_array_equal(np.asarray(new.masked), expected)
  assert 0 < expected.sum() < 3 * expected[..., 0].size  # the ε-rule removed some
  # global: ranked by the mean over layers and heads, masked everywhere
  global_mask = iv.MaskPreviousSinks(top_k=2, per_head=False)
  new = global_mask.update(global_mask.init_state(config, B, s), output, context)
  pooled = incoming.mean(axis=(0, 2))
  expected = np.zeros((B, s), bool)
  for b in range(B):
    expected[b, sorted(range(s), key=lambda j: (-pooled[b, j], j))[:2]] = True
  np.testing.assert_array_equal(np.asarray(new.masked), expected)
  assert global_mask.bias(new, context).keys.shape == (B, 1, s)


def test_mask_previous_sinks_first_step_and_bias():
  config = preset("tiny-llada")
  sink_mask = iv.MaskPreviousSinks(top_k=3, initial_keys=(0, -1))
  state = sink_mask.init_state(config, B, 6)
  expected = np.zeros(6, bool)
  expected[[0, 5]] = True
  np.testing.assert_array_equal(np.asarray(state.masked), np.broadcast_to(expected, state.masked.shape))
  np.testing.assert_array_equal(state.top_k, [3, 3])
  context = iv.CallContext(jnp.int32(0), jnp.zeros((B, 6), jnp.int32))
  bias = sink_mask.bias(state, context)
  assert bias.keys.shape == (config.n_layers, B, config.n_heads, 6)
  spare = iv.MaskPreviousSinks(spare_self=True, initial_keys=(0,))
  pairwise = spare.bias(spare.init_state(config, B, 6), context).pairwise
  assert pairwise.shape == (config.n_layers, B, config.n_heads, 6, 6)
  assert pairwise[0, 0, 0, 0, 0] == 0 and pairwise[0, 0, 0, 1, 0] == np.float32(MASK_VALUE)
  with pytest.raises(ValueError):
    iv.MaskPreviousSinks(initial_keys=(7,)).init_state(config, 1, 6)
  with pytest.raises(ValueError):
    iv.MaskPreviousSinks(top_k=-1)
  with pytest.raises(ValueError, match="per-head incoming"):
    sink_mask.update(state, ForwardOutput(logits=jnp.zeros((1,))), context)


def test_ar_variant_reads_the_last_row():
  config = preset("tiny-llama")
  ar = iv.MaskPreviousSinksAR(top_k=2, last_row_weights=True)
  assert ar.required_stats(config) == StatsSpec(incoming_attention=True, per_head=True, query_groups=1)
  state = ar.init_state(config, B, 10)
  weights = ar.query_weights(state, iv.CallContext(jnp.int32(0), jnp.zeros((B, 10), jnp.int32), 0, 4))
  np.testing.assert_array_equal(weights, np.broadcast_to([0, 0, 0, 1.0], (B, 1, 4)))
  rng = np.random.default_rng(1)
  row = rng.random((config.n_layers, B, 1, config.n_heads, 10)).astype(np.float32)
  new = ar.update(state, ForwardOutput(logits=jnp.zeros((1,)), stats={"incoming_attention": jnp.asarray(row)}), None)
  np.testing.assert_array_equal(np.asarray(new.masked), brute_top_k_masks(row[:, :, 0], [2, 2]))
  with pytest.raises(ValueError):
    iv.MaskPreviousSinksAR(epsilon=3.0)
  plain = iv.MaskPreviousSinksAR(top_k=1, per_head=False, last_row_weights=False)
  assert plain.required_stats(config).query_groups == 0 and plain.query_weights(state, None) is None
  new = plain.update(plain.init_state(config, B, 10),
                     ForwardOutput(logits=jnp.zeros((1,)), stats={"incoming_attention": jnp.asarray(row)}), None)
  pooled = row[:, :, 0].mean(axis=(0, 2))
  np.testing.assert_array_equal(np.asarray(new.masked), pooled == pooled.max(-1, keepdims=True))


def test_stats_merging_and_compose():
  config = preset("tiny-llada")
  need = iv.MaskPreviousSinks().required_stats(config)
  assert merge_specs(NO_STATS, need) == need
  assert merge_specs(StatsSpec(value_norms=True), need) == StatsSpec(True, True, None, 0, True)
  with pytest.raises(ValueError, match="Incompatible"):
    merge_specs(StatsSpec(incoming_attention=True, per_head=False), need)
  composed = iv.Compose((iv.KeyPadding(), iv.MaskPreviousSinksAR(last_row_weights=True)))
  assert composed.required_stats(config).query_groups == 1
  state = composed.init_state(config, B, 5)
  context = iv.CallContext(jnp.int32(0), jnp.zeros((B, 5), jnp.int32))
  assert composed.query_weights(state, context).shape == (B, 1, 5)
  twice = iv.Compose((iv.MaskPreviousSinksAR(last_row_weights=True),) * 2)
  with pytest.raises(ValueError):
    twice.query_weights(twice.init_state(config, B, 5), context)


def test_intervened_forward_equals_forward_with_the_bias():
  config, params = tiny_params()
  tokens = jax.random.randint(jax.random.key(2), (B, 7), 0, config.vocab_size)
  mask_keys = iv.MaskKeys()
  state = iv.MaskKeys.with_positions(mask_keys.init_state(config, B, 7), jnp.array([[1], [4]]))
  spec = StatsSpec(incoming_attention=True)
  output, new_state = intervened_forward(params, tokens, mask_keys, state, config=config, stats_spec=spec)
  reference = model.forward(params, tokens, config=config,
                            bias=iv.AttentionBias(keys=jnp.where(state, MASK_VALUE, 0.0)[:, None]), stats_spec=spec)
  np.testing.assert_allclose(output.logits, reference.logits, atol=1e-6)
  np.testing.assert_array_equal(new_state, state)
  incoming = np.asarray(squeeze_incoming(output.incoming_attention, spec))  # [L, B, N, S]
  assert np.all(incoming[:, 0, :, 1] == 0) and np.all(incoming[:, 1, :, 4] == 0)
  np.testing.assert_allclose(incoming.sum(-1), 7.0, rtol=1e-5)  # every row still sums to 1
