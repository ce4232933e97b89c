"""The train step, a resumed run and the likelihood scorers give the same results on one device and under
every mesh of 8 CPU devices (float32; only the order of the sharded reductions differs)."""

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from dlm_jax import model, training
from dlm_jax.analysis import likelihood
from dlm_jax.runtime import sharding
from dlm_jax.training import data as training_data, loop as train_loop
from dlm_jax.config import ModelConfig
from dlm_jax.tasks import synthetic

MESHES = [(1, 1, 1), (8, 1, 1), (2, 2, 2), (1, 2, 4)]
# Every sharded size divides 8: heads and kv heads 4 (tensor ≤ 4), MLP 64, vocabulary 96, width 32.
DLM = ModelConfig(name="mesh-dlm", d_model=32, n_layers=2, n_heads=4, n_kv_heads=4, head_dim=8, mlp_hidden=64,
                  vocab_size=96, rope_fp32=True, mask_token_id=3, eos_token_id=2, bos_token_id=1, pad_token_id=0)
ARM = DLM.replace(name="mesh-arm", causal=True, logit_shift=1, mask_token_id=None, qkv_bias=True)
DREAM = DLM.replace(name="mesh-dream", logit_shift=1, qkv_bias=True)
# The resume test trains this run too, so that its train steps (one compiled program per mesh) are shared.
SFT = train_loop.TrainConfig(objective="sft", sink="front", sink_token_id=4, steps=4, batch_size=8, lr=3e-3, warmup=1,
                             log_every=0, seed=5)


def _examples(layout):
  tokenizer = synthetic.build_tokenizer()
  pairs = [(p.question, p.answer) for p in synthetic.make_split("train", 40, seed=0)]
  encode = lambda text: tokenizer.encode(text, add_special_tokens=False).ids
  ids = training_data.SpecialIds(pad=0, bos=1, eos=2)
  return training_data.encode_examples(pairs, encode, layout, ids, seq_len=68,
                                       prompt_len=36 if layout == "sft" else None)


def _mesh(shape):
  return sharding.make_mesh(*shape, devices=jax.devices()[:int(np.prod(shape))])


def _max_difference(a, b):
  """Largest |a - b| over the leaves, in NumPy (no compiled subtraction per leaf shape)."""
  a, b = jax.device_get((a, b))
  return max(float(np.max(np.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.parametrize("config, train_config, layout", [
    (DLM, SFT, "sft"),
    (ARM, train_loop.TrainConfig(objective="ar", steps=3, batch_size=8, lr=3e-3, warmup=1, log_every=0, seed=6),
     "ar"),
])
def test_training_is_the_same_under_every_mesh(config, train_config, layout):
  examples = _examples(layout)
  single = train_loop.train(config, train_config, examples)
  moved = _max_difference(single.params, model.init_params(config, jax.random.key(train_config.seed)))
  assert moved > 1e-3  # a few steps at lr 3e-3 moved the weights, so agreement below is not trivial
  for shape in MESHES:
    sharded = train_loop.train(config, train_config, examples, mesh=_mesh(shape))
    assert _max_difference(single.params, sharded.params) < 2e-5, shape
    assert abs(single.metrics["loss"] - sharded.metrics["loss"]) < 1e-5, shape
  held_out = train_loop.evaluate_loss(config, train_config, single.params, examples, n_batches=2,
                                      mesh=_mesh((2, 2, 2)))
  assert abs(held_out - train_loop.evaluate_loss(config, train_config, single.params, examples, n_batches=2)) < 1e-5


def test_resume_on_another_mesh_equals_uninterrupted_single_device(tmp_path):
  examples = _examples("sft")
  tc = dataclasses.replace(SFT, checkpoint_every=2)
  full = train_loop.train(DLM, tc, examples)
  first = train_loop.train(DLM, tc, examples, run_dir=str(tmp_path), stop_after=2,
                           mesh=_mesh((2, 2, 2)))
  assert first.stopped_early and first.step == 2
  second = train_loop.train(DLM, tc, examples, run_dir=str(tmp_path), mesh=_mesh((1, 2, 4)))
  assert second.resumed_from == 2 and second.step == 4
  assert _max_difference(full.params, second.params) < 2e-5


def test_train_state_carries_the_parameter_specs_into_the_optimizer_state():
  optimizer = training.make_optimizer(lr=1e-3, total_steps=10, warmup_steps=1)
  objective = training.Objective("sft")
  layout = training.train_state_shardings(DLM, _mesh((1, 2, 4)), optimizer, objective)
  q = PartitionSpec(None, "fsdp", "tensor")
  assert layout["params"]["blocks"]["attn"]["q"]["kernel"].spec == q
  adam = layout["opt_state"][1][0]  # chain(clip, adamw) -> adamw = chain(scale_by_adam, ...) -> its state
  assert adam.mu["blocks"]["attn"]["q"]["kernel"].spec == q
  assert adam.nu["embed"]["embedding"].spec == PartitionSpec("tensor", "fsdp")
  assert adam.count.spec == PartitionSpec()
  assert layout["step"].spec == PartitionSpec()


def test_training_refuses_a_batch_that_does_not_divide_over_the_mesh():
  tc = train_loop.TrainConfig(objective="sft", steps=1, batch_size=6, log_every=0)
  with pytest.raises(ValueError, match="Batch size 6 must be a multiple of the 4 batch shards"):
    train_loop.train(DLM, tc, _examples("sft"), mesh=_mesh((2, 2, 2)))


@pytest.mark.parametrize("family, config", [("llada", DLM), ("dream", DREAM)])
def test_likelihood_is_the_same_under_every_mesh(family, config):
  params = model.init_params(config, jax.random.key(3))
  prompt, answer = np.array([5, 9, 12, 7, 30, 11]), np.array([40, 41, 8, 2])
  score = {"llada": likelihood.llada_log_likelihood, "dream": likelihood.dream_log_likelihood}[family]
  kwargs = dict(config=config, mc_num=16, batch_size=8, cfg_scale=0.5)
  single = score(params, prompt, answer, jax.random.key(9), **kwargs)
  for shape in MESHES:
    mesh = _mesh(shape)
    placed = jax.device_put(params, sharding.param_shardings(config, mesh, params))
    assert abs(score(placed, prompt, answer, jax.random.key(9), mesh=mesh, **kwargs) - single) < 1e-5, shape
