"""Block-causal attention (`ModelConfig.attention_block_size`): parity with transformers, statistics, the
exact block-by-block KV cache, and config validation.

The reference is transformers' Llama / Qwen2 (built by tests/test_model_parity.py) run with eager attention
and an explicit 4-D additive mask built the way LLaDA2 and SDAR build theirs: a lower-triangular
[blocks, blocks] matrix expanded by the block size in both axes and cropped to the sequence length.
"""

import numpy as np
import pytest
import torch
import jax
import jax.numpy as jnp

from dlm_jax import model
from dlm_jax.model.attention import attention
from dlm_jax.config import ConfigError, ModelConfig, preset
from dlm_jax.instrument.stats import StatsSpec, squeeze_incoming
from dlm_jax.model import CallInstruments, Compute

try:
  from tests.test_model_parity import _our_params, _reference
except ImportError:
  from test_model_parity import _our_params, _reference

IMPLS = [("dense", 128), ("chunked", 5), ("fused", 5)]


def block_causal_reference_mask(length: int, block: int) -> np.ndarray:
  """[T, T] float32 additive mask: 0 where the key's block is not after the query's block, -inf elsewhere."""
  n_blocks = -(-length // block)
  allowed = np.kron(np.tril(np.ones((n_blocks, n_blocks))), np.ones((block, block)))[:length, :length]
  return np.where(allowed > 0, 0.0, -np.inf).astype(np.float32)


CASES = [
    # family, d, layers, heads, kv_heads, mlp, vocab, theta, eps, block
    ("llama", 48, 2, 4, 2, 72, 97, 10000.0, 1e-5, 4),     # GQA x2; 4 does not divide T = 19
    ("llama", 48, 2, 4, 4, 72, 97, 500000.0, 1e-5, 1),    # block 1 is token-causal
    ("qwen2", 56, 2, 7, 1, 88, 113, 1e6, 1e-6, 7),        # q/k/v bias, GQA x7; 7 does not divide 19
    ("qwen2", 48, 3, 6, 2, 80, 101, 1e6, 1e-6, 32),       # one block longer than T: bidirectional
]


@pytest.mark.parametrize("family, d, layers, heads, kv_heads, mlp, vocab, theta, eps, block", CASES)
def test_logits_and_statistics_match_transformers_with_a_block_causal_mask(family, d, layers, heads, kv_heads, mlp,
                                                                          vocab, theta, eps, block):
  reference = _reference(family, d=d, layers=layers, heads=heads, kv_heads=kv_heads, mlp=mlp, vocab=vocab,
                         theta=theta, eps=eps, tied=False, seed=block + heads)
  config = ModelConfig(name=f"{family}-block-causal", d_model=d, n_layers=layers, n_heads=heads,
                       n_kv_heads=kv_heads, head_dim=d // heads, mlp_hidden=mlp, vocab_size=vocab, norm_eps=eps,
                       rope_theta=theta, qkv_bias=family == "qwen2", rope_fp32=family == "llama",
                       attention_block_size=block)
  params = _our_params(reference, family, layers, False)
  b, t = 2, 19
  tokens = np.random.default_rng(block).integers(0, vocab, size=(b, t))
  mask = np.broadcast_to(block_causal_reference_mask(t, block), (b, 1, t, t)).copy()
  with torch.no_grad():
    out = reference(input_ids=torch.as_tensor(tokens), attention_mask=torch.as_tensor(mask),
                    output_attentions=True)
  ref_logits = out.logits.numpy()
  ref_probs = np.stack([a.numpy() for a in out.attentions])  # [L, B, N, T, S]

  # Group 0: the queries of the first block (weight 1); group 1: every query with a random positive weight.
  first_block = (np.arange(t) < block).astype(np.float32)
  weights = np.stack([np.broadcast_to(first_block, (b, t)),
                      np.random.default_rng(1).uniform(0.5, 2.0, size=(b, t)).astype(np.float32)], axis=1)
  ref_grouped = np.einsum("bqt,lbnts->lbqns", weights, ref_probs)  # [L, B, Q, N, S]
  spec = StatsSpec(incoming_attention=True)
  grouped_spec = StatsSpec(incoming_attention=True, query_groups=2)
  for impl, chunk in IMPLS:
    ours = model.forward(params, jnp.asarray(tokens), config=config, instruments=CallInstruments(stats_spec=spec),
                         compute=Compute(attention_impl=impl, query_chunk=chunk))
    np.testing.assert_allclose(ours.logits, ref_logits, atol=1e-4, rtol=0, err_msg=impl)
    np.testing.assert_allclose(squeeze_incoming(ours.incoming_attention, spec), ref_probs.sum(axis=3), atol=1e-5,
                               rtol=0, err_msg=impl)
    grouped = model.forward(params, jnp.asarray(tokens), config=config,
                            instruments=CallInstruments(query_weights=jnp.asarray(weights), stats_spec=grouped_spec),
                            compute=Compute(attention_impl=impl, query_chunk=chunk))
    np.testing.assert_allclose(grouped.incoming_attention, ref_grouped, atol=1e-5, rtol=0, err_msg=impl)
    # The first block's queries give exactly zero probability to every later key.
    assert (np.asarray(grouped.incoming_attention)[:, :, 0, :, block:] == 0).all(), impl


@pytest.mark.parametrize("name", ["tiny-llada", "tiny-dream"])
@pytest.mark.parametrize("impl, chunk", [("dense", 128), ("chunked", 2), ("fused", 2)])
def test_block_by_block_kv_cache_equals_the_uncached_pass(name, impl, chunk):
  """Prefill of the prompt's complete blocks, then each block as its own cached call at cache_offset = its start
  (first with mask tokens, then again with its final tokens, which overwrite the block's slots): the final calls'
  logits are those of one uncached forward over the whole sequence, and their incoming attention adds up to it."""
  block, prompt_len, total, b = 3, 7, 16, 2  # blocks [0,3) [3,6) | [6,9) [9,12) [12,15) [15,16)
  config = preset(name).replace(attention_block_size=block)
  params = model.init_params(config, jax.random.key(11))
  tokens = jax.random.randint(jax.random.key(12), (b, total), 0, config.vocab_size - 1)
  spec = StatsSpec(incoming_attention=True)
  full = model.forward(params, tokens, config=config, instruments=CallInstruments(stats_spec=spec),
                       compute=Compute(attention_impl=impl, query_chunk=chunk))

  @jax.jit
  def cached_call(block_tokens, cache, offset):
    return model.forward(params, block_tokens, config=config, instruments=CallInstruments(stats_spec=spec),
                         compute=Compute(attention_impl=impl, query_chunk=chunk, cache=cache, cache_offset=offset))

  prefill_end = prompt_len // block * block
  out = model.forward(params, tokens[:, :prefill_end], config=config, instruments=CallInstruments(stats_spec=spec),
                      compute=Compute(attention_impl=impl, query_chunk=chunk,
                                      cache=model.KVCache.zeros(config, b, total), cache_offset=0))
  logits, incoming, cache = [out.logits], out.incoming_attention, out.cache
  for start in range(prefill_end, total, block):
    stop = min(start + block, total)
    masks = jnp.full((b, stop - start), config.mask_token_id, tokens.dtype)  # not weakly typed: tokens' program
    cache = cached_call(masks, cache, jnp.int32(start)).cache
    out = cached_call(tokens[:, start:stop], cache, jnp.int32(start))
    assert (np.asarray(out.incoming_attention)[..., stop:] == 0).all()  # keys of later blocks: zero probability
    logits.append(out.logits)
    incoming, cache = incoming + out.incoming_attention, out.cache
  np.testing.assert_allclose(jnp.concatenate(logits, axis=1), full.logits, atol=1e-5, rtol=0)
  np.testing.assert_allclose(incoming, full.incoming_attention, atol=1e-5, rtol=0)


def test_block_size_one_is_causal_and_a_single_block_is_bidirectional():
  config = preset("tiny-dream")
  params = model.init_params(config, jax.random.key(2))
  tokens = jax.random.randint(jax.random.key(3), (2, 10), 0, config.vocab_size)
  logits = lambda c: model.forward(params, tokens, config=c).logits
  np.testing.assert_allclose(logits(config.replace(attention_block_size=1)), logits(config.replace(causal=True)),
                             atol=1e-6, rtol=0)
  np.testing.assert_allclose(logits(config.replace(attention_block_size=10)), logits(config), atol=1e-6, rtol=0)


@pytest.mark.parametrize("value", [0, -4, 2.5, True, "4"])
def test_invalid_block_sizes_name_the_field(value):
  with pytest.raises(ConfigError, match="attention_block_size must be None or a positive integer"):
    preset("tiny-llada").replace(attention_block_size=value)


def test_block_causal_and_causal_are_exclusive():
  with pytest.raises(ValueError, match=r"attention_block_size=4 .* causal=True"):
    preset("tiny-llama").replace(attention_block_size=4)


def test_block_causal_config_is_hashable_and_round_trips_through_json():
  config = preset("tiny-llada").replace(attention_block_size=32)
  assert ModelConfig.from_json(config.to_json()) == config
  assert hash(ModelConfig.from_json(config.to_json())) == hash(config)
  assert config != preset("tiny-llada") and preset("tiny-llada").attention_block_size is None
  values = preset("tiny-llada").to_dict()
  del values["attention_block_size"]  # a config.json written before the field existed
  assert ModelConfig.from_dict(values).attention_block_size is None


def test_attention_rejects_a_non_positive_block_size():
  x = jnp.zeros((1, 4, 2, 8))
  with pytest.raises(ValueError, match="block_size"):
    attention(x, x, x, scale=1.0, block_size=0)
