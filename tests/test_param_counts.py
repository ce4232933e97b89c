"""Real-size parameter counts from abstract shapes (nothing is allocated)."""

import math

import jax
import pytest

from dlm_jax import model
from dlm_jax.config import preset


@pytest.mark.parametrize("name, expected", [
    ("llada-8b", 8_015_581_184),
    ("mmada-8b", 8_082_690_048),
    ("dream-7b", 7_615_616_512),
    ("llama3-8b", 8_030_261_248),
    ("qwen2.5-7b", 7_615_616_512),
])
def test_real_presets_have_the_published_parameter_counts(name, expected):
  abstract = model.abstract_params(preset(name))
  leaves = jax.tree.leaves(abstract)
  assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves)
  assert sum(math.prod(leaf.shape) for leaf in leaves) == expected
  assert model.param_count(preset(name)) == expected


def test_llada_shapes_follow_the_checkpoint_layout():
  shapes = jax.tree.map(lambda leaf: leaf.shape, model.abstract_params(preset("llada-8b")))
  assert shapes["embed"]["embedding"] == (126464, 4096)
  assert shapes["lm_head"]["kernel"] == (4096, 126464)
  assert shapes["blocks"]["attn"]["q"]["kernel"] == (32, 4096, 4096)
  assert shapes["blocks"]["mlp"]["down"]["kernel"] == (32, 12288, 4096)
  dream = jax.tree.map(lambda leaf: leaf.shape, model.abstract_params(preset("dream-7b")))
  assert dream["blocks"]["attn"]["k"]["bias"] == (28, 512)
  assert "lm_head" not in model.abstract_params(preset("smollm2-135m"))


def test_flat_names_round_trip():
  params = model.init_params(preset("tiny-dream"), jax.random.key(0))
  flat = model.flatten_params(params)
  assert "blocks.attn.q.bias" in flat and "embed.embedding" in flat
  restored = model.unflatten_params(flat)
  assert jax.tree.structure(restored) == jax.tree.structure(params)
