"""Losses against brute-force NumPy loops, the extra sink token, the optimizer and the data order."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dlm_jax import training
from dlm_jax.training import objectives
from dlm_jax.training import data as training_data
from dlm_jax.model.attention import AttentionBias
from dlm_jax.config import preset
from dlm_jax.model import CallInstruments, forward, init_params
from dlm_jax.instrument.stats import StatsSpec

DLM = preset("tiny-llada")   # mask 255, bidirectional, logit_shift 0
ARM = preset("tiny-llama")   # causal, logit_shift 1
B, L = 3, 10


def _batch(seed=0, prompt_lengths=(4, 2, 6)):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(3, 200, (B, L)).astype(np.int32)
  prompt_mask = np.arange(L)[None, :] < np.asarray(prompt_lengths)[:, None]
  target_mask = np.ones((B, L), bool)
  target_mask[1, 7:] = False   # row 1: padding at the end (AR)
  tokens[1, 7:] = ARM.pad_token_id
  return {"tokens": jnp.asarray(tokens), "prompt_mask": jnp.asarray(prompt_mask),
          "target_mask": jnp.asarray(target_mask)}


def _log_softmax(row):
  row = np.asarray(row, np.float64)
  return row - row.max() - np.log(np.exp(row - row.max()).sum())


def test_noise_draw_matches_llada_forward_process():
  noise = training.draw_noise(jax.random.key(1), 64, 4000)
  p, masked = np.asarray(noise.p), np.asarray(noise.masked)
  assert p.shape == (64,) and masked.shape == (64, 4000)
  assert np.all(p >= 1e-3) and np.all(p <= 1.0)
  np.testing.assert_allclose(masked.mean(axis=1), p, atol=0.03)   # iid Bernoulli(p) per row
  again = training.draw_noise(jax.random.key(1), 64, 4000)
  np.testing.assert_array_equal(masked, np.asarray(again.masked))


@pytest.mark.parametrize("kind", ["pretrain", "sft"])
def test_diffusion_losses_equal_brute_force(kind):
  params = init_params(DLM, jax.random.key(0))
  batch, key = _batch(), jax.random.key(7)
  objective = training.Objective(kind)
  loss, metrics = training.loss_fn(params, batch, key, config=DLM, objective=objective)

  noise = training.draw_noise(key, B, L)            # replay the draw
  p, drawn = np.asarray(noise.p), np.asarray(noise.masked)
  tokens, prompt = np.asarray(batch["tokens"]), np.asarray(batch["prompt_mask"])
  noisy = tokens.copy()
  masked = np.zeros_like(drawn)
  for b in range(B):
    for i in range(L):
      if drawn[b, i] and not (kind == "sft" and prompt[b, i]):
        masked[b, i] = True
        noisy[b, i] = DLM.mask_token_id
  assert kind == "pretrain" or not np.any(masked & prompt)
  logits = np.asarray(forward(params, jnp.asarray(noisy), config=DLM).logits)
  total = 0.0
  for b in range(B):
    answer_len = L - prompt[b].sum()
    for i in range(L):
      if masked[b, i]:
        ce = -_log_softmax(logits[b, i])[tokens[b, i]]
        total += ce / p[b] if kind == "pretrain" else ce / (p[b] * answer_len)
  expected = total / (B * L) if kind == "pretrain" else total / B
  np.testing.assert_allclose(float(loss), expected, rtol=1e-5)
  assert int(metrics["scored"]) == masked.sum()


def test_sft_never_masks_prompt_even_at_full_noise():
  batch = _batch()
  noise = training.Noise(p=jnp.ones(B), masked=jnp.ones((B, L), bool))
  noisy, masked = training.diffusion_inputs(batch, noise, config=DLM, kind="sft")
  prompt = np.asarray(batch["prompt_mask"])
  np.testing.assert_array_equal(np.asarray(noisy)[prompt], np.asarray(batch["tokens"])[prompt])
  np.testing.assert_array_equal(np.asarray(masked), ~prompt)


def test_ar_loss_equals_brute_force():
  params = init_params(ARM, jax.random.key(0))
  batch = _batch()
  loss, metrics = training.loss_fn(params, batch, jax.random.key(0), config=ARM, objective=training.Objective("ar"))
  tokens, targets = np.asarray(batch["tokens"]), np.asarray(batch["target_mask"])
  logits = np.asarray(forward(params, batch["tokens"], config=ARM).logits)
  total, count = 0.0, 0
  for b in range(B):
    for i in range(L - 1):
      if targets[b, i + 1]:
        total += -_log_softmax(logits[b, i])[tokens[b, i + 1]]
        count += 1
  np.testing.assert_allclose(float(loss), total / count, rtol=1e-5)
  assert int(metrics["scored"]) == count == B * (L - 1) - 3


def test_logit_shift_diffusion_never_masks_first_position():
  config = preset("tiny-dream")
  noise = training.Noise(p=jnp.ones(B), masked=jnp.ones((B, L), bool))
  _, masked = training.diffusion_inputs(_batch(), noise, config=config, kind="pretrain")
  assert not np.any(np.asarray(masked)[:, 0]) and np.all(np.asarray(masked)[:, 1:])
  loss, _ = training.loss_fn(init_params(config, jax.random.key(0)), _batch(), jax.random.key(2), config=config,
                             objective=training.Objective("pretrain"))
  assert np.isfinite(float(loss))


@pytest.mark.parametrize("placement", ["front", "end"])
def test_sink_token_is_never_masked_nor_scored(placement, monkeypatch):
  sink = training.SinkTokenSpec(token_id=254, placement=placement)
  objective = training.Objective("sft", sink=sink, eps=1.0)   # p = 1: every answer token masked
  params = init_params(DLM, jax.random.key(0))
  batch, key = _batch(), jax.random.key(3)
  calls = []
  real_forward = objectives.forward

  def recording_forward(params, tokens, **kwargs):
    calls.append((np.asarray(tokens), kwargs))
    return real_forward(params, tokens, **kwargs)

  monkeypatch.setattr(objectives, "forward", recording_forward)
  loss, metrics = training.loss_fn(params, batch, key, config=DLM, objective=objective)
  (tokens, kwargs), = calls
  k = 0 if placement == "front" else L
  assert tokens.shape == (B, L + 1)
  assert np.all(tokens[:, k] == 254)                                  # present and never masked
  assert np.sum(tokens == DLM.mask_token_id) == np.sum(~np.asarray(batch["prompt_mask"]))
  window = kwargs["readout"].window
  assert not window[0] <= k < window[1] and window[1] - window[0] == L   # its output is never computed
  content = np.delete(tokens, k, axis=1)
  np.testing.assert_array_equal(np.asarray(kwargs["positions"][0]), np.arange(L + 1))
  bias = np.asarray(kwargs["instruments"].bias.pairwise)[0, 0]
  assert np.all(bias[k, np.arange(L + 1) != k] < -1e30) and bias[k, k] == 0   # sink row sees only itself
  assert np.all(np.delete(bias, k, axis=0) == 0)                              # everyone sees everything
  # Brute force over the content positions only.
  logits = np.asarray(real_forward(params, jnp.asarray(tokens), config=DLM, positions=kwargs["positions"],
                                   instruments=CallInstruments(bias=kwargs["instruments"].bias)).logits)
  logits = np.delete(logits, k, axis=1)
  original, prompt = np.asarray(batch["tokens"]), np.asarray(batch["prompt_mask"])
  total = 0.0
  for b in range(B):
    for i in range(L):
      if content[b, i] == DLM.mask_token_id:
        total += -_log_softmax(logits[b, i])[original[b, i]] / (L - prompt[b].sum())
  np.testing.assert_allclose(float(loss), total / B, rtol=1e-5)
  assert int(metrics["scored"]) == np.sum(~prompt)


def test_sink_attention_changes_only_through_the_bias():
  """Without the bias row, the sink's own query would see the content: the outputs must differ."""
  sink = training.SinkTokenSpec(token_id=254)
  params = init_params(DLM, jax.random.key(0))
  tokens = _batch()["tokens"]
  with_sink = training.model_logits(params, tokens, config=DLM, sink=sink)
  full = forward(params, sink.insert(tokens), config=DLM).logits[:, 1:]
  assert with_sink.shape == (B, L, DLM.vocab_size)
  assert not np.allclose(np.asarray(with_sink), np.asarray(full))


def test_zero_value_sink_stays_zero_and_has_zero_values():
  sink = training.SinkTokenSpec(token_id=254, placement="front", zero_value=True)
  objective = training.Objective("sft", sink=sink)
  optimizer = training.make_optimizer(lr=1e-2, total_steps=3, warmup_steps=0)
  state = training.init_train_state(DLM, jax.random.key(0), optimizer, objective)
  step = training.make_train_step(DLM, objective, optimizer)
  for s in range(2):
    state, _ = step(state, _batch(), training.step_key(0, s))
  params = state["params"]
  np.testing.assert_array_equal(np.asarray(params["embed"]["embedding"][254]), 0.0)
  assert np.any(np.asarray(params["embed"]["embedding"][253]) != 0)
  out = forward(params, sink.insert(_batch()["tokens"]), config=DLM,
                instruments=CallInstruments(bias=AttentionBias(pairwise=sink.bias(L)),
                                            stats_spec=StatsSpec(value_norms=True)))
  norms = np.asarray(out.value_norms)   # [L, B, K, S]
  np.testing.assert_array_equal(norms[..., 0], 0.0)
  assert np.all(norms[..., 1:] > 0)
  with pytest.raises(ValueError, match="qkv_bias"):
    training.Objective("sft", sink=sink).check(preset("tiny-dream"))


def test_objective_checks():
  with pytest.raises(ValueError, match="causal"):
    training.Objective("ar").check(DLM)
  with pytest.raises(ValueError, match="bidirectional"):
    training.Objective("sft").check(ARM)
  with pytest.raises(ValueError, match="sink"):
    training.Objective("ar", sink=training.SinkTokenSpec(254))


def test_schedule_and_weight_decay_mask():
  schedule = training.learning_rate_schedule(1e-3, total_steps=100, warmup_steps=10, end_ratio=0.1)
  np.testing.assert_allclose([float(schedule(i)) for i in (0, 5, 10, 100)], [0.0, 5e-4, 1e-3, 1e-4], rtol=1e-5)
  params = init_params(DLM, jax.random.key(0))
  optimizer = training.make_optimizer(lr=1.0, total_steps=10, warmup_steps=0, weight_decay=0.5, clip_norm=1e9)
  zero_grads = jax.tree.map(jnp.zeros_like, params)
  updates, _ = optimizer.update(zero_grads, optimizer.init(params), params)
  # With zero gradients only weight decay moves a parameter: matrices shrink, norm weights do not.
  np.testing.assert_allclose(np.asarray(updates["blocks"]["attn"]["q"]["kernel"]),
                             -0.5 * np.asarray(params["blocks"]["attn"]["q"]["kernel"]), rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(updates["final_norm"]["weight"]), 0.0)
  clipped = optax.clip_by_global_norm(1.0)
  big = jax.tree.map(lambda x: jnp.full_like(x, 10.0), params)
  out, _ = clipped.update(big, clipped.init(params))
  np.testing.assert_allclose(float(optax.tree.norm(out)), 1.0, rtol=1e-5)


def test_layouts():
  ids = training_data.SpecialIds(pad=0, bos=1, eos=2)
  encode = lambda text: [int(t) for t in text.split()]
  sft = training_data.encode_examples([("7 8", "9 10 11")], encode, "sft", ids, seq_len=9, prompt_len=4)
  np.testing.assert_array_equal(sft.tokens[0], [0, 1, 7, 8, 9, 10, 11, 2, 2])
  np.testing.assert_array_equal(sft.prompt_mask[0], [1, 1, 1, 1, 0, 0, 0, 0, 0])
  ar = training_data.encode_examples([("7 8", "9")], encode, "ar", ids, seq_len=7)
  np.testing.assert_array_equal(ar.tokens[0], [1, 7, 8, 9, 2, 0, 0])
  np.testing.assert_array_equal(ar.target_mask[0], [1, 1, 1, 1, 1, 0, 0])
  doc = training_data.encode_examples([("7 8", "9")], encode, "document", ids, seq_len=7)
  np.testing.assert_array_equal(doc.tokens[0], [1, 7, 8, 9, 2, 2, 2])
  np.testing.assert_array_equal(training_data.left_padded_prompts(["7 8"], encode, ids, 4), [[0, 1, 7, 8]])
  with pytest.raises(ValueError, match="answer"):
    training_data.encode_examples([("7", "1 2 3 4 5")], encode, "sft", ids, seq_len=8, prompt_len=4)


def test_data_order_depends_only_on_seed_and_step():
  n, batch = 10, 4
  stream = np.concatenate([training_data.batch_indices(5, s, batch, n) for s in range(5)])
  for epoch in range(2):
    assert sorted(stream[epoch * n:(epoch + 1) * n]) == list(range(n))   # each epoch is a permutation
  np.testing.assert_array_equal(training_data.batch_indices(5, 3, batch, n), stream[12:16])
  assert not np.array_equal(stream[:n], stream[n:2 * n])
  assert not np.array_equal(training_data.batch_indices(6, 0, batch, n), stream[:batch])
