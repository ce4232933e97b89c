"""Logits and incoming attention against transformers' Llama and Qwen2 on random tiny configs.

The reference runs eager attention with an explicit 4-D float mask (zeros for bidirectional, -inf above
the diagonal for causal), so it computes exactly the attention we ask of our model and returns the
per-layer probabilities, whose column sums are the incoming attention.
"""

import numpy as np
import pytest
import torch
import transformers
import jax
import jax.numpy as jnp

from dlm_jax import model
from dlm_jax.model.attention import AttentionBias
from dlm_jax.config import ModelConfig
from dlm_jax.instrument.stats import StatsSpec, squeeze_incoming
from dlm_jax.model import CallInstruments, Compute, Readout


def _reference(family, *, d, layers, heads, kv_heads, mlp, vocab, theta, eps, tied, seed):
  torch.manual_seed(seed)
  cls_config, cls_model = {
      "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
      "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
  }[family]
  hf_config = cls_config(vocab_size=vocab, hidden_size=d, intermediate_size=mlp, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, rope_theta=theta,
                         rms_norm_eps=eps, tie_word_embeddings=tied, attn_implementation="eager",
                         dtype=torch.float32)
  reference = cls_model(hf_config).eval()
  with torch.no_grad():  # random norms and biases so that every parameter matters
    for name, p in reference.named_parameters():
      if "norm" in name:
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
      elif name.endswith("bias"):
        p.copy_(0.2 * torch.randn_like(p))
  return reference


def _our_params(reference, family, layers, tied):
  """Maps the HF state dict onto our tree: Linear weights [out, in] -> kernels [in, out], layers stacked."""
  sd = {k: v.detach().numpy() for k, v in reference.state_dict().items()}

  def stacked(name, transpose=True):
    arrays = [sd[f"model.layers.{i}.{name}"] for i in range(layers)]
    return jnp.asarray(np.stack([a.T if transpose else a for a in arrays]))

  attn = {}
  for ours, theirs in [("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("o", "o_proj")]:
    attn[ours] = {"kernel": stacked(f"self_attn.{theirs}.weight")}
    if family == "qwen2" and ours != "o":
      attn[ours]["bias"] = stacked(f"self_attn.{theirs}.bias", transpose=False)
  params = {
      "embed": {"embedding": jnp.asarray(sd["model.embed_tokens.weight"])},
      "blocks": {
          "attn_norm": {"weight": stacked("input_layernorm.weight", transpose=False)},
          "attn": attn,
          "mlp_norm": {"weight": stacked("post_attention_layernorm.weight", transpose=False)},
          "mlp": {name: {"kernel": stacked(f"mlp.{name}_proj.weight")} for name in ("gate", "up", "down")},
      },
      "final_norm": {"weight": jnp.asarray(sd["model.norm.weight"])},
  }
  if not tied:
    params["lm_head"] = {"kernel": jnp.asarray(sd["lm_head.weight"].T)}
  return params


CASES = [
    # family, d, layers, heads, kv_heads, head_dim (= d / heads in HF), mlp, vocab, theta, eps, tied
    ("llama", 48, 2, 4, 4, 72, 97, 10000.0, 1e-5, False),   # MHA, untied
    ("llama", 64, 3, 8, 2, 96, 131, 500000.0, 1e-5, False),  # GQA x4
    ("llama", 48, 2, 6, 3, 80, 101, 100000.0, 1e-5, True),   # GQA x2, tied (SmolLM2-like)
    ("qwen2", 56, 2, 7, 1, 88, 113, 1e6, 1e-6, False),       # q/k/v bias, GQA x7 (Dream-like)
]


@pytest.mark.parametrize("family, d, layers, heads, kv_heads, mlp, vocab, theta, eps, tied", CASES)
@pytest.mark.parametrize("causal", [False, True])
def test_logits_and_incoming_attention_match_transformers(family, d, layers, heads, kv_heads, mlp, vocab, theta,
                                                          eps, tied, causal):
  reference = _reference(family, d=d, layers=layers, heads=heads, kv_heads=kv_heads, mlp=mlp, vocab=vocab,
                         theta=theta, eps=eps, tied=tied, seed=layers * 7 + heads)
  config = ModelConfig(name=f"{family}-parity", d_model=d, n_layers=layers, n_heads=heads, n_kv_heads=kv_heads,
                       head_dim=d // heads, mlp_hidden=mlp, vocab_size=vocab, norm_eps=eps, rope_theta=theta,
                       qkv_bias=family == "qwen2", tied_embeddings=tied, causal=causal,
                       rope_fp32=family == "llama")
  params = _our_params(reference, family, layers, tied)
  b, t = 2, 19
  tokens = np.random.default_rng(t).integers(0, vocab, size=(b, t))
  mask = np.zeros((b, 1, t, t), np.float32)
  if causal:
    mask = np.where(np.triu(np.ones((t, t), bool), k=1), -np.inf, 0.0).astype(np.float32)[None, None]
    mask = np.broadcast_to(mask, (b, 1, t, t)).copy()
  with torch.no_grad():
    out = reference(input_ids=torch.as_tensor(tokens), attention_mask=torch.as_tensor(mask),
                    output_attentions=True)
  ref_logits = out.logits.numpy()
  ref_incoming = np.stack([a.numpy().sum(axis=2) for a in out.attentions])  # [L, B, N, S]

  spec = StatsSpec(incoming_attention=True)
  for impl, chunk in [("dense", 128), ("chunked", 5), ("fused", 5)]:
    ours = model.forward(params, jnp.asarray(tokens), config=config, instruments=CallInstruments(stats_spec=spec),
                         compute=Compute(attention_impl=impl, query_chunk=chunk))
    np.testing.assert_allclose(ours.logits, ref_logits, atol=1e-4, rtol=0)
    assert ours.incoming_attention.shape == (layers, b, 1, heads, t)  # [L, B, Q, N, S]
    np.testing.assert_allclose(squeeze_incoming(ours.incoming_attention, spec), ref_incoming, atol=1e-5, rtol=0)


def test_logits_window_and_stats_reductions_agree_with_the_full_pass():
  reference = _reference("qwen2", d=32, layers=3, heads=4, kv_heads=2, mlp=48, vocab=61, theta=1e6, eps=1e-6,
                         tied=False, seed=0)
  config = ModelConfig(name="w", d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8, mlp_hidden=48,
                       vocab_size=61, norm_eps=1e-6, rope_theta=1e6, qkv_bias=True)
  params = _our_params(reference, "qwen2", 3, False)
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 61, size=(2, 12)))
  full_spec = StatsSpec(incoming_attention=True, value_norms=True)
  full = model.forward(params, tokens, config=config, instruments=CallInstruments(stats_spec=full_spec))
  window_spec = StatsSpec(incoming_attention=True, per_head=False, layers=(2, 0), value_norms=True)
  window = model.forward(params, tokens, config=config, readout=Readout(window=(4, 9)),
                         instruments=CallInstruments(stats_spec=window_spec))
  np.testing.assert_allclose(window.logits, full.logits[:, 4:9], atol=1e-6)
  shifted = jax.jit(lambda offset: model.forward(params, tokens, config=config,
                                                 readout=Readout(window=(2, 5), offset=offset)).logits)
  for offset in (0, 3, 7):  # one compiled program, the window moved by a traced offset
    np.testing.assert_allclose(shifted(jnp.int32(offset)), full.logits[:, 2 + offset:5 + offset], atol=1e-6)
  full_incoming = squeeze_incoming(full.incoming_attention, full_spec)
  np.testing.assert_allclose(squeeze_incoming(window.incoming_attention, window_spec),
                             full_incoming[np.array([2, 0])].mean(axis=2), atol=1e-6)
  np.testing.assert_allclose(window.value_norms, full.value_norms[np.array([2, 0])], atol=1e-6)
  assert full.value_norms.shape == (3, 2, 2, 12)
  weights = jnp.stack([jnp.arange(12) < 5, jnp.arange(12) >= 5], 0)[None].repeat(2, 0).astype(jnp.float32)
  grouped_spec = StatsSpec(incoming_attention=True, query_groups=2)
  grouped = model.forward(params, tokens, config=config,
                          instruments=CallInstruments(query_weights=weights, stats_spec=grouped_spec))
  np.testing.assert_allclose(squeeze_incoming(grouped.incoming_attention, grouped_spec).sum(axis=2), full_incoming,
                             atol=1e-5)


def test_kv_cache_decoding_matches_the_full_causal_pass():
  config = ModelConfig(name="cache", d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, mlp_hidden=40,
                       vocab_size=50, causal=True, logit_shift=1)
  params = model.init_params(config, jax.random.key(3))
  tokens = jax.random.randint(jax.random.key(4), (2, 10), 0, 50)
  full = model.forward(params, tokens, config=config).logits
  cache = model.KVCache.zeros(config, 2, 16)
  prefill = model.forward(params, tokens[:, :6], config=config, compute=Compute(cache=cache, cache_offset=0))
  steps, cache = [prefill.logits], prefill.cache
  for i in range(6, 10):
    out = model.forward(params, tokens[:, i:i + 1], config=config, compute=Compute(cache=cache, cache_offset=i))
    steps.append(out.logits)
    cache = out.cache
  np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, atol=1e-5)


def test_per_layer_biases_reach_their_layer_only():
  config = ModelConfig(name="bias", d_model=32, n_layers=2, n_heads=4, n_kv_heads=4, head_dim=8, mlp_hidden=40,
                       vocab_size=50)
  params = model.init_params(config, jax.random.key(5))
  tokens = jax.random.randint(jax.random.key(6), (1, 9), 0, 50)
  spec = StatsSpec(incoming_attention=True)
  key_bias = jnp.zeros((2, 1, 4, 9)).at[1, :, :, 3].set(-1e30)  # mask key 3 in layer 1 only
  out = model.forward(params, tokens, config=config,
                      instruments=CallInstruments(bias=AttentionBias(keys=key_bias, keys_per_layer=True),
                                                  stats_spec=spec))
  incoming = squeeze_incoming(out.incoming_attention, spec)
  assert (incoming[1, :, :, 3] == 0).all()
  assert (incoming[0, :, :, 3] > 0).all()
  shared = model.forward(params, tokens, config=config,
                         instruments=CallInstruments(bias=AttentionBias(keys=key_bias[1]), stats_spec=spec))
  assert (squeeze_incoming(shared.incoming_attention, spec)[:, :, :, 3] == 0).all()


def test_zero_values_match_a_reference_whose_value_rows_are_zeroed():
  """transformers with a hook zeroing v_proj's output at position 2 (values carry no RoPE)."""
  reference = _reference("llama", d=32, layers=2, heads=4, kv_heads=2, mlp=48, vocab=53, theta=1e4, eps=1e-5,
                         tied=False, seed=9)
  config = ModelConfig(name="zv", d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, mlp_hidden=48,
                       vocab_size=53, rope_theta=1e4)
  params = _our_params(reference, "llama", 2, False)

  def zero_position_2(module, inputs, output):
    output = output.clone()
    output[:, 2] = 0
    return output

  hooks = [layer.self_attn.v_proj.register_forward_hook(zero_position_2) for layer in reference.model.layers]
  tokens = np.random.default_rng(0).integers(0, 53, size=(2, 9))
  with torch.no_grad():
    expected = reference(input_ids=torch.as_tensor(tokens), attention_mask=torch.zeros(2, 1, 9, 9)).logits.numpy()
  for hook in hooks:
    hook.remove()
  zero_values = jnp.zeros((1, 9), bool).at[:, 2].set(True)
  ours = model.forward(params, jnp.asarray(tokens), config=config,
                       instruments=CallInstruments(bias=AttentionBias(zero_values=zero_values)))
  np.testing.assert_allclose(ours.logits, expected, atol=1e-4, rtol=0)
