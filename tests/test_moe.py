"""Mixture-of-experts feed-forward, QK norm and partial RoPE against transformers on tiny random configs.

References (float32, eager attention, explicit all-visible 4-D mask, highest matmul precision):
- OLMoE (`OlmoeForCausalLM`): softmax top-k router without (and with) renormalisation — the LLaDA-MoE
  router. OLMoE normalises q and k over the whole projection width, so it is run with one head, where
  that equals our per-head QK norm.
- Qwen3-MoE (`Qwen3MoeForCausalLM`): the same router with several heads, per-head QK norm, GQA and a
  leading dense layer (`mlp_only_layers=[0]`).
- GLM-4-MoE (`Glm4MoeForCausalLM`): sigmoid router with a score-correction bias, group-limited top-k,
  renormalisation and scaling, one always-on shared expert, a leading dense layer, per-head QK norm and
  partial RoPE with standard GQA attention — every part of LLaDA2.x except its fused-QKV tensor names.
- DeepSeek-V3 (`DeepseekV3MoE`, the MoE block alone on random hidden states; the model uses MLA
  attention, which we do not implement).
- Qwen2-MoE (`Qwen2MoeSparseMoeBlock`): softmax top-k with renormalisation; its shared expert is scaled by
  a sigmoid gate that neither LLaDA-MoE nor LLaDA2.x has, so the gated shared term (computed by the
  reference's own modules) is subtracted and the routed mixture is compared.
Routing is checked decision by decision: the chosen expert sets of every token in every MoE layer equal
the reference's, and their weights agree.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from dlm_jax import model
from dlm_jax.runtime import sharding
from dlm_jax.config import ConfigError, ModelConfig, preset
from dlm_jax.model import CallInstruments, Compute, Readout

try:
  from tests import hf_fixtures
except ImportError:
  import hf_fixtures


def _hf_moe_params(get, config: ModelConfig, prefix: str = "mlp.") -> dict:
  """Our MoE feed-forward tree from HF tensors: get(name) -> array ([..., out, in] Linear layout, stacked
  expert tensors `experts.gate_up_proj` [..., E, 2F, D] (gate rows first) and `experts.down_proj`
  [..., E, D, F]), any leading layer axis kept."""
  t = lambda a: np.swapaxes(a, -1, -2)
  f = config.expert_hidden
  gate_up = get(f"{prefix}experts.gate_up_proj")
  params = {
      "router": {"kernel": t(get(f"{prefix}gate.weight"))},
      "experts": {"gate": {"kernel": t(gate_up[..., :f, :])}, "up": {"kernel": t(gate_up[..., f:, :])},
                  "down": {"kernel": t(get(f"{prefix}experts.down_proj"))}},
  }
  if config.router == "sigmoid_group":
    params["router"]["score_bias"] = get(f"{prefix}gate.e_score_correction_bias")
  if config.n_shared_experts:
    params["shared"] = {n: {"kernel": t(get(f"{prefix}shared_experts.{n}_proj.weight"))}
                        for n in ("gate", "up", "down")}
  return jax.tree.map(jnp.asarray, params)


def _hf_model_params(reference, config: ModelConfig) -> dict:
  """Our full tree from an HF Llama-layout MoE model (OLMoE, GLM-4-MoE): layers [0, k) -> `dense_blocks`,
  [k, L) -> `blocks`."""
  sd = {k: v.detach().numpy() for k, v in reference.state_dict().items()}

  def stack(layers, name, transpose=True):
    return np.stack([sd[f"model.layers.{i}.{name}"].T if transpose else sd[f"model.layers.{i}.{name}"]
                     for i in layers])

  def blocks(layers, moe):
    attn = {ours: {"kernel": stack(layers, f"self_attn.{theirs}_proj.weight")}
            for ours, theirs in [("q", "q"), ("k", "k"), ("v", "v"), ("o", "o")]}
    if config.qk_norm:
      attn["q_norm"] = {"weight": stack(layers, "self_attn.q_norm.weight", False)}
      attn["k_norm"] = {"weight": stack(layers, "self_attn.k_norm.weight", False)}
    if moe:
      mlp = _hf_moe_params(lambda name: stack(layers, name, False), config)
    else:
      mlp = {n: {"kernel": stack(layers, f"mlp.{n}_proj.weight")} for n in ("gate", "up", "down")}
    return jax.tree.map(jnp.asarray, {
        "attn_norm": {"weight": stack(layers, "input_layernorm.weight", False)}, "attn": attn,
        "mlp_norm": {"weight": stack(layers, "post_attention_layernorm.weight", False)}, "mlp": mlp})

  k = config.first_k_dense
  params = {
      "embed": {"embedding": jnp.asarray(sd["model.embed_tokens.weight"])},
      "blocks": blocks(range(k, config.n_layers), config.is_moe),
      "final_norm": {"weight": jnp.asarray(sd["model.norm.weight"])},
      "lm_head": {"kernel": jnp.asarray(sd["lm_head.weight"].T)},
  }
  if k:
    params["dense_blocks"] = blocks(range(k), False)
  return params


def _module(cls, config, pure):
  """An NNX module of class `cls` (MoE, Router) holding the pure parameter dict `pure`."""
  return nnx.merge(nnx.graphdef(nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0), dtype=jnp.float32))), pure)


def _capture_routing(gates):
  """Forward hooks on HF router modules; returns (records, handles), records[i] = (input, weights, idx)."""
  records = [None] * len(gates)

  def hook(i, module, inputs, output):
    records[i] = (inputs[0].detach().reshape(-1, inputs[0].shape[-1]).numpy(), output[1].detach().numpy(),
                  output[2].detach().numpy())

  return records, [g.register_forward_hook(functools.partial(hook, i)) for i, g in enumerate(gates)]


def _assert_same_routing(config, router_params, hf_input, hf_weights, hf_experts):
  """Our router on the reference's router input chooses the same expert set per token, same weights."""
  weights, experts = _module(model.Router, config, router_params)(jnp.asarray(hf_input))
  weights, experts = np.asarray(weights), np.asarray(experts)
  ours_order, theirs_order = np.argsort(experts, axis=-1), np.argsort(hf_experts, axis=-1)
  np.testing.assert_array_equal(np.take_along_axis(experts, ours_order, -1),
                                np.take_along_axis(hf_experts, theirs_order, -1))
  np.testing.assert_allclose(np.take_along_axis(weights, ours_order, -1),
                             np.take_along_axis(hf_weights, theirs_order, -1), atol=1e-6, rtol=0)
  return experts


def _layer_router(params, config, layer):
  """Router parameters of absolute layer `layer` (an MoE layer) from the full tree."""
  return jax.tree.map(lambda a: a[layer - config.first_k_dense], params["blocks"]["mlp"]["router"])


def _compare_full_model(reference, config, tokens):
  params = _hf_model_params(reference, config)
  gates = [layer.mlp.gate for layer in reference.model.layers[config.first_k_dense:]]
  records, handles = _capture_routing(gates)
  ref_logits, ref_incoming = hf_fixtures.reference_outputs(reference, tokens, bidirectional=True)
  for h in handles:
    h.remove()
  from dlm_jax.instrument.stats import StatsSpec, squeeze_incoming
  spec = StatsSpec(incoming_attention=True)
  out = jax.jit(functools.partial(model.forward, config=config, stats_spec=spec))(params, jnp.asarray([tokens]))
  logits_diff = float(np.abs(np.asarray(out.logits[0]) - ref_logits).max())
  np.testing.assert_allclose(out.logits[0], ref_logits, atol=1e-4, rtol=0)
  np.testing.assert_allclose(squeeze_incoming(out.incoming_attention, spec)[:, 0], ref_incoming, atol=1e-5, rtol=0)
  chosen = [_assert_same_routing(config, _layer_router(params, config, config.first_k_dense + i), *rec)
            for i, rec in enumerate(records)]
  return logits_diff, chosen, records


@pytest.mark.parametrize("renormalize", [False, True])
def test_softmax_topk_model_matches_olmoe(renormalize):
  d, layers, experts, k, f, vocab = 40, 3, 8, 3, 24, 71
  hf_config = transformers.OlmoeConfig(
      vocab_size=vocab, hidden_size=d, intermediate_size=f, num_hidden_layers=layers, num_attention_heads=1,
      num_key_value_heads=1, num_experts=experts, num_experts_per_tok=k, norm_topk_prob=renormalize,
      rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
      tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=1, attn_implementation="eager",
      dtype=torch.float32)
  reference = transformers.OlmoeForCausalLM(hf_config)
  hf_fixtures.randomize_parameters(reference, seed=3)
  reference.eval()
  config = ModelConfig(name="olmoe-parity", d_model=d, n_layers=layers, n_heads=1, n_kv_heads=1, head_dim=d,
                       mlp_hidden=8, vocab_size=vocab, norm_eps=1e-5, rope_theta=50000.0, qk_norm=True,
                       n_experts=experts, experts_per_token=k, expert_hidden=f, router="softmax_topk",
                       router_renormalize=renormalize, router_fp32=False)
  tokens = np.random.default_rng(0).integers(0, vocab, size=19).tolist()
  diff, chosen, _ = _compare_full_model(reference, config, tokens)
  assert diff < 1e-4
  assert len({int(e) for c in chosen for e in c.ravel()}) == experts  # every expert is used somewhere


@pytest.mark.parametrize("renormalize", [False, True])
def test_softmax_topk_model_with_per_head_qk_norm_and_a_dense_layer_matches_qwen3_moe(renormalize):
  """LLaDA-MoE's layout with several heads: per-head QK norm, GQA, softmax router, a leading dense layer."""
  d, layers, heads, kv_heads, head_dim, experts, k, f, dense_f, vocab = 48, 3, 4, 2, 16, 8, 3, 20, 56, 67
  hf_config = transformers.Qwen3MoeConfig(
      vocab_size=vocab, hidden_size=d, intermediate_size=dense_f, moe_intermediate_size=f, num_hidden_layers=layers,
      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, num_experts=experts,
      num_experts_per_tok=k, norm_topk_prob=renormalize, mlp_only_layers=[0], decoder_sparse_step=1,
      rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
      tie_word_embeddings=False, attn_implementation="eager", dtype=torch.float32)
  reference = transformers.Qwen3MoeForCausalLM(hf_config)
  hf_fixtures.randomize_parameters(reference, seed=4)
  reference.eval()
  config = ModelConfig(name="qwen3moe-parity", d_model=d, n_layers=layers, n_heads=heads, n_kv_heads=kv_heads,
                       head_dim=head_dim, mlp_hidden=dense_f, vocab_size=vocab, norm_eps=1e-5, rope_theta=50000.0,
                       qk_norm=True, n_experts=experts, experts_per_token=k, expert_hidden=f, first_k_dense=1,
                       router="softmax_topk", router_renormalize=renormalize, router_fp32=False)
  tokens = np.random.default_rng(2).integers(0, vocab, size=17).tolist()
  diff, _, _ = _compare_full_model(reference, config, tokens)
  assert diff < 1e-4


def _glm4_moe(*, d, layers, heads, kv_heads, head_dim, dense_f, experts, k, f, shared, groups, kept, scale,
              rotary, vocab, seed):
  hf_config = transformers.Glm4MoeConfig(
      vocab_size=vocab, hidden_size=d, intermediate_size=dense_f, moe_intermediate_size=f,
      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
      n_routed_experts=experts, num_experts_per_tok=k, n_shared_experts=shared, first_k_dense_replace=1,
      n_group=groups, topk_group=kept, routed_scaling_factor=scale, norm_topk_prob=True, use_qk_norm=True,
      attention_bias=False, rms_norm_eps=1e-6, tie_word_embeddings=False, attn_implementation="eager",
      rope_parameters={"rope_type": "default", "rope_theta": 600000.0, "partial_rotary_factor": rotary / head_dim},
      dtype=torch.float32)
  reference = transformers.Glm4MoeForCausalLM(hf_config)
  hf_fixtures.randomize_parameters(reference, seed=seed)
  generator = torch.Generator().manual_seed(seed + 1)
  with torch.no_grad():  # a selection bias large enough to change choices, small enough to keep s + b > 0
    for layer in reference.model.layers[1:]:
      layer.mlp.gate.e_score_correction_bias.copy_(0.2 * torch.rand(experts, generator=generator))
  return reference.eval()


def test_sigmoid_group_model_with_shared_experts_and_dense_layer_matches_glm4_moe():
  dims = dict(d=48, layers=3, heads=4, kv_heads=2, head_dim=16, dense_f=56, experts=16, k=4, f=20, shared=2,
              groups=4, kept=2, scale=2.5, rotary=8, vocab=83)
  reference = _glm4_moe(**dims, seed=11)
  config = ModelConfig(
      name="glm4-moe-parity", d_model=dims["d"], n_layers=dims["layers"], n_heads=dims["heads"],
      n_kv_heads=dims["kv_heads"], head_dim=dims["head_dim"], mlp_hidden=dims["dense_f"], vocab_size=dims["vocab"],
      norm_eps=1e-6, rope_theta=600000.0, qk_norm=True, rotary_dim=dims["rotary"], n_experts=dims["experts"],
      experts_per_token=dims["k"], expert_hidden=dims["f"], n_shared_experts=dims["shared"],
      shared_expert_hidden=dims["f"], first_k_dense=1, router="sigmoid_group", router_renormalize=True,
      router_groups=dims["groups"], router_topk_groups=dims["kept"], routed_scaling_factor=dims["scale"])
  tokens = np.random.default_rng(1).integers(0, dims["vocab"], size=23).tolist()
  diff, chosen, records = _compare_full_model(reference, config, tokens)
  assert diff < 1e-4
  params = _hf_model_params(reference, config)
  unbiased = [np.sort(np.asarray(_module(model.Router, config, {**_layer_router(params, config, 1 + i),
                                                                "score_bias": jnp.zeros(dims["experts"])})(
                          jnp.asarray(rec[0]))[1]), axis=-1) for i, rec in enumerate(records)]
  assert any((np.sort(c, axis=-1) != u).any() for c, u in zip(chosen, unbiased))  # the bias changed choices
  per_group = dims["experts"] // dims["groups"]
  for experts in chosen:  # group limit: at most `kept` groups per token
    assert max(len(set(row // per_group)) for row in experts) <= dims["kept"]


def test_selection_bias_changes_choices_but_not_weights_formula():
  """With the bias, the chosen set differs from the unbiased top-k for some tokens (so the bias matters)."""
  config = ModelConfig(name="b", d_model=16, n_layers=1, n_heads=2, n_kv_heads=2, head_dim=8, mlp_hidden=8,
                       vocab_size=8, n_experts=8, experts_per_token=2, expert_hidden=4, router="sigmoid_group",
                       router_groups=1, router_topk_groups=1)
  logits = jax.random.normal(jax.random.key(0), (64, 8))
  bias = jnp.zeros(8).at[0].set(0.5)
  weights, experts = model.route(config, logits, bias)
  plain_weights, plain = model.route(config, logits, jnp.zeros(8))
  assert (np.asarray(experts) == 0).any(axis=1).mean() > (np.asarray(plain) == 0).any(axis=1).mean()
  np.testing.assert_allclose(weights, np.take_along_axis(np.asarray(jax.nn.sigmoid(logits)), np.asarray(experts), -1),
                             atol=1e-7)


def test_sigmoid_group_block_matches_deepseek_v3_moe():
  d, experts, k, f, shared = 32, 32, 6, 12, 1
  hf_config = transformers.DeepseekV3Config(
      hidden_size=d, intermediate_size=40, moe_intermediate_size=f, n_routed_experts=experts,
      num_experts_per_tok=k, n_shared_experts=shared, n_group=8, topk_group=3, routed_scaling_factor=2.5,
      norm_topk_prob=True, dtype=torch.float32)
  from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
  block = DeepseekV3MoE(hf_config)
  hf_fixtures.randomize_parameters(block, seed=5)
  with torch.no_grad():
    block.gate.e_score_correction_bias.copy_(0.2 * torch.rand(experts, generator=torch.Generator().manual_seed(6)))
  block.eval()
  config = ModelConfig(name="dsv3-block", d_model=d, n_layers=1, n_heads=2, n_kv_heads=2, head_dim=16,
                       mlp_hidden=8, vocab_size=8, n_experts=experts, experts_per_token=k, expert_hidden=f,
                       n_shared_experts=shared, shared_expert_hidden=f, router="sigmoid_group",
                       router_renormalize=True, router_groups=8, router_topk_groups=3, routed_scaling_factor=2.5)
  sd = {name: v.detach().numpy() for name, v in block.state_dict().items()}
  params = _hf_moe_params(sd.__getitem__, config, prefix="")
  x = torch.randn(2, 13, d, generator=torch.Generator().manual_seed(7))
  records, handles = _capture_routing([block.gate])
  with torch.no_grad():
    expected = block(x).numpy()
  handles[0].remove()
  ours, _ = _module(model.MoE, config, params)(jnp.asarray(x.numpy()))
  np.testing.assert_allclose(ours, expected, atol=1e-5, rtol=0)
  _assert_same_routing(config, params["router"], *records[0])


def test_softmax_topk_renormalized_block_matches_qwen2_moe_routed_part():
  d, experts, k, f = 32, 12, 4, 16
  hf_config = transformers.Qwen2MoeConfig(
      hidden_size=d, moe_intermediate_size=f, shared_expert_intermediate_size=24, num_experts=experts,
      num_experts_per_tok=k, norm_topk_prob=True, dtype=torch.float32)
  from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
  block = Qwen2MoeSparseMoeBlock(hf_config)
  hf_fixtures.randomize_parameters(block, seed=8)
  block.eval()
  config = ModelConfig(name="qwen2moe-block", d_model=d, n_layers=1, n_heads=2, n_kv_heads=2, head_dim=16,
                       mlp_hidden=8, vocab_size=8, n_experts=experts, experts_per_token=k, expert_hidden=f,
                       router="softmax_topk", router_renormalize=True)
  sd = {name: v.detach().numpy() for name, v in block.state_dict().items()}
  params = _hf_moe_params(sd.__getitem__, config, prefix="")
  x = torch.randn(2, 11, d, generator=torch.Generator().manual_seed(9))
  records, handles = _capture_routing([block.gate])
  with torch.no_grad():
    gated_shared = torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
    expected = (block(x) - gated_shared).numpy()
  handles[0].remove()
  ours, _ = _module(model.MoE, config, params)(jnp.asarray(x.numpy()))
  np.testing.assert_allclose(ours, expected, atol=1e-5, rtol=0)
  _assert_same_routing(config, params["router"], *records[0])


def _numpy_moe(x, weights, experts, gate, up, down, capacity):
  """Reference mixture: loops over tokens in order, each expert serving at most `capacity` pairs."""
  used = np.zeros(gate.shape[0], int)
  out = np.zeros_like(x)
  silu = lambda a: a / (1 + np.exp(-a))
  for m in range(x.shape[0]):
    for w, e in zip(weights[m], experts[m]):
      if capacity is not None and used[e] >= capacity:
        continue
      used[e] += 1
      out[m] += w * ((silu(x[m] @ gate[e]) * (x[m] @ up[e])) @ down[e])
  return out


@pytest.mark.parametrize("capacity_factor", [None, 0.5, 1.0, 100.0])
def test_expert_dispatch_and_capacity_match_a_token_loop(capacity_factor):
  config = ModelConfig(name="cap", d_model=16, n_layers=1, n_heads=2, n_kv_heads=2, head_dim=8, mlp_hidden=8,
                       vocab_size=8, n_experts=6, experts_per_token=2, expert_hidden=10,
                       capacity_factor=capacity_factor)
  experts_module = model.Experts(config, rngs=nnx.Rngs(0), dtype=jnp.float32)
  x = jax.random.normal(jax.random.key(1), (30, 16))
  weights, experts = model.route(config, jax.random.normal(jax.random.key(2), (30, 6)) * 3)
  capacity = None if capacity_factor is None else math.ceil(capacity_factor * 30 * 2 / 6)
  expected = _numpy_moe(*map(np.asarray, (x, weights, experts, experts_module.gate.kernel[...],
                                          experts_module.up.kernel[...], experts_module.down.kernel[...])), capacity)
  np.testing.assert_allclose(experts_module(x, weights, experts), expected, atol=1e-5, rtol=0)


def _tiny_moe(**overrides):
  return preset("tiny-llada2").replace(**overrides)


@pytest.mark.parametrize("name", ["tiny-llada-moe", "tiny-llada2"])
def test_tiny_moe_presets_run_jitted_with_windows_and_block_causal_attention(name):
  config = preset(name)
  params = model.init_params(config, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 11), 0, config.vocab_size)
  full = jax.jit(functools.partial(model.forward, config=config))(params, tokens).logits
  window = model.forward(params, tokens, config=config, readout=Readout(window=(3, 8))).logits
  np.testing.assert_allclose(window, full[:, 3:8], atol=1e-5, rtol=0)  # jitted vs eager rounding
  assert np.isfinite(np.asarray(full)).all()
  if config.attention_block_size:  # the last block (positions 8-10) cannot change the first two blocks
    changed = model.forward(params, tokens.at[:, 9].set(0), config=config).logits
    np.testing.assert_allclose(changed[:, :8], full[:, :8], atol=1e-5, rtol=0)


def test_kv_cache_and_layer_subsets_cross_the_dense_to_moe_boundary():
  from dlm_jax.model.attention import AttentionBias
  from dlm_jax.instrument.stats import StatsSpec
  config = _tiny_moe(causal=True, attention_block_size=None, logit_shift=1, mask_token_id=None)
  params = model.init_params(config, jax.random.key(3))
  tokens = jax.random.randint(jax.random.key(4), (2, 10), 0, config.vocab_size)
  spec = StatsSpec(incoming_attention=True, value_norms=True)
  full = model.forward(params, tokens, config=config, instruments=CallInstruments(stats_spec=spec))
  subset = model.forward(params, tokens, config=config, stats_spec=StatsSpec(incoming_attention=True,
                                                                              value_norms=True, layers=(2, 0)))
  np.testing.assert_allclose(subset.incoming_attention, full.incoming_attention[np.array([2, 0])], atol=1e-6)
  np.testing.assert_allclose(subset.value_norms, full.value_norms[np.array([2, 0])], atol=1e-6)
  cache = model.KVCache.zeros(config, 2, 16)
  prefill = model.forward(params, tokens[:, :6], config=config, compute=Compute(cache=cache))
  steps, cache = [prefill.logits], prefill.cache
  for i in range(6, 10):
    out = model.forward(params, tokens[:, i:i + 1], config=config, compute=Compute(cache=cache, cache_offset=i))
    steps.append(out.logits)
    cache = out.cache
  np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full.logits, atol=1e-5)
  key_bias = jnp.zeros((3, 1, 4, 10)).at[2, :, :, 3].set(-1e30)  # mask key 3 in the last (MoE) layer only
  masked = model.forward(params, tokens, config=config,
                         instruments=CallInstruments(stats_spec=StatsSpec(incoming_attention=True),
                                                     bias=AttentionBias(keys=key_bias, keys_per_layer=True)))
  assert (masked.incoming_attention[2, ..., 3] == 0).all() and (masked.incoming_attention[:2, ..., 3] > 0).all()


def test_moe_forward_is_the_same_under_a_sharded_mesh():
  config = _tiny_moe()
  params = model.init_params(config, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (4, 12), 0, config.vocab_size)
  reference = model.forward(params, tokens, config=config).logits
  mesh = sharding.make_mesh(2, 2, 2)
  placed = jax.device_put(params, sharding.param_shardings(config, mesh, params))
  specs = jax.tree.map(lambda s: s.spec, sharding.param_shardings(config, mesh, params))
  assert specs["blocks"]["mlp"]["experts"]["gate"]["kernel"] == jax.sharding.PartitionSpec(None, "tensor", "fsdp", None)
  tokens = jax.device_put(tokens, sharding.batch_sharding(mesh, tokens.ndim))
  out = jax.jit(functools.partial(model.forward, config=config))(placed, tokens)
  np.testing.assert_allclose(out.logits, reference, atol=1e-5)


@pytest.mark.parametrize("overrides", [dict(), dict(first_k_dense=0, n_shared_experts=0, shared_expert_hidden=0,
                                                     router="softmax_topk", router_groups=1, router_topk_groups=1,
                                                     routed_scaling_factor=1.0)])
def test_param_axes_cover_moe_trees(overrides):
  config = _tiny_moe(**overrides)
  flat = model.flatten_params(model.abstract_params(config))
  assert ("dense_blocks.mlp.gate.kernel" in flat) == bool(config.first_k_dense)
  sizes = {"embed": config.d_model, "vocab": config.vocab_size, "heads": config.n_heads * config.head_dim,
           "kv_heads": config.n_kv_heads * config.head_dim, "mlp": config.mlp_hidden, "expert": config.n_experts,
           "shared_mlp": config.n_shared_experts * config.shared_expert_hidden,
           "layers": None}
  for tensor, leaf in flat.items():
    axes = model.PARAM_AXES[tensor]
    assert len(axes) == len(leaf.shape), tensor
    stacked = tensor.startswith(("blocks.", "dense_blocks."))
    assert (axes[0] == "layers") == stacked, tensor
    if stacked:
      expected_layers = config.first_k_dense if tensor.startswith("dense_") else config.n_layers - config.first_k_dense
      assert leaf.shape[0] == expected_layers, tensor
    for axis, size in zip(axes[1:] if stacked else axes, leaf.shape[1:] if stacked else leaf.shape):
      assert axis is None or sizes[axis] == size, (tensor, axis)


def test_dense_defaults_have_no_moe_parameters():
  flat = model.flatten_params(model.abstract_params(preset("tiny-llada")))
  moe_only = (".router.", ".experts.", ".shared.", "dense_blocks.", "attn.q_norm", "attn.k_norm")
  assert not [name for name in flat if any(part in name for part in moe_only)]


@pytest.mark.parametrize("overrides, message", [
    (dict(n_experts=0), "needs a mixture-of-experts model"),
    (dict(experts_per_token=9), r"experts_per_token must be in \[1, n_experts=8\]"),
    (dict(expert_hidden=0), "expert_hidden must be positive"),
    (dict(shared_expert_hidden=0), "must both be positive"),
    (dict(first_k_dense=3), "first_k_dense .3. must be below n_layers"),
    (dict(router="topk"), "router must be"),
    (dict(router_groups=3), "must divide n_experts"),
    (dict(router_topk_groups=1, experts_per_token=3), "must hold experts_per_token"),
    (dict(router="softmax_topk"), "apply to router='sigmoid_group' only"),
    (dict(capacity_factor=0), "capacity_factor must be None"),
    (dict(rotary_dim=7), "rotary_dim must be None or an even integer"),
    (dict(rotary_dim=32), "rotary_dim must be None or an even integer"),
    (dict(routed_scaling_factor=-1.0), "routed_scaling_factor must be a positive number"),
])
def test_invalid_moe_configs_say_what_to_change(overrides, message):
  with pytest.raises(ConfigError, match=message):
    _tiny_moe(**overrides)


def test_expert_matrices_are_weight_decayed_and_the_selection_bias_is_not():
  from dlm_jax.training import objectives
  flat = model.flatten_params(objectives._decay_mask(model.abstract_params(preset("tiny-llada2"))))
  assert all(flat[f"blocks.mlp.experts.{n}.kernel"] for n in ("gate", "up", "down"))
  assert flat["blocks.mlp.router.kernel"] and flat["blocks.mlp.shared.up.kernel"]
  assert not flat["blocks.mlp.router.score_bias"] and not flat["blocks.attn.q_norm.weight"]
