"""ModelConfig validation, presets and JSON round trip."""

import ast
import dataclasses
import inspect
import json

import pytest

from dlm_jax.config import PRESETS, ConfigError, ModelConfig, model_config, preset


def test_presets_are_hashable_and_round_trip_through_json():
  for name, config in PRESETS.items():
    assert hash(config) == hash(ModelConfig.from_json(config.to_json())), name
    assert ModelConfig.from_json(config.to_json()) == config


def test_real_presets_carry_the_reference_values():
  llada = preset("llada-8b")
  assert (llada.d_model, llada.n_layers, llada.n_heads, llada.n_kv_heads, llada.mlp_hidden) == (4096, 32, 32, 32,
                                                                                              12288)
  assert (llada.vocab_size, llada.mask_token_id, llada.eos_token_id, llada.eot_token_id) == (126464, 126336, 126081,
                                                                                             126348)
  assert llada.rope_fp32 and not llada.causal and llada.logit_shift == 0
  dream = preset("dream-7b")
  assert (dream.n_heads, dream.n_kv_heads, dream.mask_token_id, dream.logit_shift) == (28, 4, 151666, 1)
  assert dream.qkv_bias and not dream.causal and dream.norm_eps == 1e-6
  assert preset("mmada-8b").vocab_size == 134656
  assert preset("llama3-8b").causal and preset("llama3-8b").n_kv_heads == 8
  smol = preset("smollm2-135m")
  assert smol.tied_embeddings and (smol.n_heads, smol.n_kv_heads, smol.head_dim) == (9, 3, 64)


@pytest.mark.parametrize("change, words", [
    (dict(n_heads=6, n_kv_heads=4), "multiple of n_kv_heads"),
    (dict(d_model=0), "d_model"),
    (dict(n_layers=2.5), "n_layers"),
    (dict(head_dim=7), "even"),
    (dict(logit_shift=2), "logit_shift"),
    (dict(norm_eps=0.0), "norm_eps"),
    (dict(mask_token_id=256), "mask_token_id"),
    (dict(causal="yes"), "causal"),
    (dict(fused_projections=1), "fused_projections must be a bool"),
    (dict(name=7), "name must be a string"),
    (dict(attention_scale=-1.0), "attention_scale"),
    (dict(global_rope_fraction=1.5), "global_rope_fraction"),
    (dict(mlp_activation="relu"), "mlp_activation"),
    (dict(sliding_window=4), "sliding_window applies to models with sliding and global layers"),
    (dict(router_groups=2), "router_groups=2 needs a mixture-of-experts model"),
])
def test_invalid_values_name_the_field(change, words):
  with pytest.raises(ConfigError, match=words):
    preset("tiny-llada").replace(**change)


def test_every_field_is_documented_beside_it_in_a_named_group():
  """Read from the source: each ModelConfig field has its docstring right after it, and the fields sit under
  the nine group comments, in this order."""
  tree = ast.parse(inspect.getsource(model_config))
  cls = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "ModelConfig")
  fields = [(i, node.target.id) for i, node in enumerate(cls.body) if isinstance(node, ast.AnnAssign)]
  assert [name for _, name in fields] == [f.name for f in dataclasses.fields(ModelConfig)]
  for i, name in fields:
    doc = cls.body[i + 1]
    assert isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str), name
    assert len(doc.value.value.split()) >= 2, name
  lines = inspect.getsource(ModelConfig).splitlines()
  groups = [line.strip() for line in lines if line.startswith("  # ")]
  assert [g.split(":")[0].rstrip(".").removeprefix("# ").split(" (")[0] for g in groups] == [
      "The shape", "Attention", "Rotary positions", "Norms, embedding and output", "Special tokens",
      "The feed-forward and its mixture of experts", "Sliding and global layers", "The Gemma-4 block",
      "Compute options"]


def test_from_dict_rejects_unknown_and_missing_keys():
  values = preset("tiny-dream").to_dict()
  with pytest.raises(ConfigError, match="Unknown ModelConfig keys"):
    ModelConfig.from_dict({**values, "hidden_size": 3})
  del values["d_model"]
  with pytest.raises(ConfigError, match="missing required keys"):
    ModelConfig.from_json(json.dumps(values))


def test_unknown_preset_lists_the_choices():
  with pytest.raises(ConfigError, match="llada-8b"):
    preset("llada-9b")
