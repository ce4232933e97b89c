"""Sharded forward passes equal the single-device one; partition specs and per-device bytes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from dlm_jax import model
from dlm_jax.runtime import sharding
from dlm_jax.config import ModelConfig, preset
from dlm_jax.instrument.stats import StatsSpec

MESHES = [(1, 1, 1), (8, 1, 1), (2, 2, 2), (1, 2, 4)]
CONFIG = ModelConfig(name="shard-test", d_model=32, n_layers=2, n_heads=8, n_kv_heads=4, head_dim=8,
                     mlp_hidden=64, vocab_size=64, qkv_bias=True, mask_token_id=63)


def _run(mesh_sizes, params, tokens):
  mesh = sharding.make_mesh(*mesh_sizes, devices=jax.devices()[:int(np.prod(mesh_sizes))])
  placed = jax.device_put(params, sharding.param_shardings(CONFIG, mesh, params))
  tokens = jax.device_put(tokens, sharding.batch_sharding(mesh, tokens.ndim))
  run = jax.jit(functools.partial(model.forward, config=CONFIG, logits_window=(3, 9),
                                  stats_spec=StatsSpec(incoming_attention=True, value_norms=True)))
  return run(placed, tokens)


def test_forward_is_the_same_under_every_mesh():
  params = model.init_params(CONFIG, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (8, 12), 0, 64)
  reference = _run((1, 1, 1), params, tokens)
  for mesh_sizes in MESHES[1:]:
    out = _run(mesh_sizes, params, tokens)
    np.testing.assert_allclose(out.logits, reference.logits, atol=1e-5, err_msg=str(mesh_sizes))
    np.testing.assert_allclose(out.incoming_attention, reference.incoming_attention, atol=1e-5)
    np.testing.assert_allclose(out.value_norms, reference.value_norms, atol=1e-5)


def test_parameters_carry_the_expected_partition_specs():
  mesh = sharding.make_mesh(2, 2, 2)
  params = model.abstract_params(CONFIG)
  specs = jax.tree.map(lambda s: s.spec, sharding.param_shardings(CONFIG, mesh, params))
  assert specs["embed"]["embedding"] == P("tensor", "fsdp")
  assert specs["blocks"]["attn"]["q"]["kernel"] == P(None, "fsdp", "tensor")
  assert specs["blocks"]["attn"]["k"]["bias"] == P(None, "tensor")
  assert specs["blocks"]["attn"]["o"]["kernel"] == P(None, "tensor", "fsdp")
  assert specs["blocks"]["mlp"]["down"]["kernel"] == P(None, "tensor", "fsdp")
  assert specs["blocks"]["attn_norm"]["weight"] == P(None, None)
  assert specs["lm_head"]["kernel"] == P("fsdp", "tensor")


def _norm_elements(config):
  return 2 * config.n_layers * config.d_model + config.d_model


@pytest.mark.parametrize("name", ["llada-8b", "mmada-8b", "llama3-8b"])
@pytest.mark.parametrize("mesh_sizes, weight_shards", [((1, 1, 8), 8), ((1, 8, 1), 8), ((2, 2, 2), 4),
                                                       ((8, 1, 1), 1)])
def test_bytes_per_device_match_the_documented_arithmetic(name, mesh_sizes, weight_shards):
  """bf16: every matrix is split over fsdp x tensor shards, the norms are replicated, data replicates all."""
  config = preset(name)
  abstract = model.abstract_params(config, jnp.bfloat16)
  total = model.param_count(config)
  norms = _norm_elements(config)
  expected = 2 * ((total - norms) // weight_shards + norms)
  mesh = sharding.make_mesh(*mesh_sizes)
  assert sharding.bytes_per_device(abstract, sharding.param_shardings(config, mesh, abstract)) == expected


def test_dream_kv_heads_bound_the_tensor_axis():
  mesh = sharding.make_mesh(1, 1, 7, devices=jax.devices()[:7])  # 28 query heads split 7 ways, 4 kv heads not
  with pytest.raises(ValueError, match=r"kv heads \(4\)"):
    sharding.param_shardings(preset("dream-7b"), mesh, model.abstract_params(preset("dream-7b")))
  sharding.check_rules(preset("dream-7b"), sharding.make_mesh(2, 1, 4))


def test_mesh_flags_parse_and_errors_are_clear():
  assert sharding.parse_mesh("data:2,tensor:4") == {"data": 2, "fsdp": 1, "tensor": 4}
  with pytest.raises(ValueError, match="AXIS:SIZE"):
    sharding.parse_mesh("model:2")
  with pytest.raises(ValueError, match="needs 6 devices"):
    sharding.make_mesh(1, 2, 3)
  with pytest.raises(ValueError, match="multiple of the 4 batch shards"):
    sharding.check_batch(6, sharding.make_mesh(2, 2, 2))


@pytest.mark.parametrize("name", ["tiny-llada", "tiny-dream", "smollm2-135m"])
def test_param_axes_table_covers_every_parameter_with_its_rank(name):
  """model.PARAM_AXES, the one declaration of logical axes, names every parameter of the tree (biases and
  the untied head included or absent as the config says) with one logical name per dimension."""
  config = preset(name)
  flat = model.flatten_params(model.abstract_params(config))
  assert set(flat) <= set(model.PARAM_AXES)
  for tensor, leaf in flat.items():
    axes = model.PARAM_AXES[tensor]
    assert len(axes) == len(leaf.shape), tensor
    assert axes[0] == "layers" if tensor.startswith("blocks.") else "layers" not in axes, tensor
  sizes = {"layers": config.n_layers, "embed": config.d_model, "vocab": config.vocab_size,
           "heads": config.n_heads * config.head_dim, "kv_heads": config.n_kv_heads * config.head_dim,
           "mlp": config.mlp_hidden}
  for tensor, leaf in flat.items():
    for axis, size in zip(model.PARAM_AXES[tensor], leaf.shape):
      assert axis is None or sizes[axis] == size, (tensor, axis)
