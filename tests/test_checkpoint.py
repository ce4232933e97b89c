"""dlm_jax.io.checkpoint: streaming writer, atomic save, validated loading with dtypes and shardings, orbax state."""

import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors.numpy import save_file

from dlm_jax.io import checkpoint
from dlm_jax.config import ConfigError, preset
from dlm_jax.model import flatten_params, init_params

def _params(name="tiny-dream", seed=0):
  config = preset(name)
  return config, init_params(config, jax.random.key(seed))


def _flat_numpy(params):
  return {n: np.asarray(v) for n, v in flatten_params(params).items()}


def _assert_same(a, b):
  fa, fb = _flat_numpy(a), _flat_numpy(b)
  assert sorted(fa) == sorted(fb)
  for name in fa:
    np.testing.assert_array_equal(fa[name], fb[name], err_msg=name)


def _write_raw(directory, config, tensors):
  """A converted-format directory with arbitrary (possibly wrong) tensors."""
  os.makedirs(directory, exist_ok=True)
  checkpoint.write_config(directory, config)
  save_file(tensors, os.path.join(directory, "model.safetensors"))


def test_save_load_roundtrip_single_file(tmp_path):
  config, params = _params()
  (tmp_path / "tok").mkdir()
  (tmp_path / "tok" / "tokenizer.json").write_text('{"x": 1}')
  checkpoint.save(tmp_path / "ckpt", config, params, tokenizer_dir=tmp_path / "tok")
  assert sorted(os.listdir(tmp_path / "ckpt")) == ["config.json", "model.safetensors", "tokenizer.json"]
  loaded_config, loaded = checkpoint.load(tmp_path / "ckpt")
  assert loaded_config == config
  _assert_same(params, loaded)
  assert jax.tree.structure(loaded) == jax.tree.structure(params)


def test_save_load_multi_shard_with_index(tmp_path):
  config, params = _params("tiny-llada")
  checkpoint.save(tmp_path / "ckpt", config, params, max_shard_bytes=40_000)
  files = sorted(os.listdir(tmp_path / "ckpt"))
  shards = [f for f in files if f.endswith(".safetensors")]
  assert len(shards) >= 3 and checkpoint.INDEX_FILE in files
  index = json.loads((tmp_path / "ckpt" / checkpoint.INDEX_FILE).read_text())
  assert set(index["weight_map"]) == set(checkpoint.expected_tensors(config))
  assert set(index["weight_map"].values()) == set(shards)
  _, loaded = checkpoint.load(tmp_path / "ckpt")
  _assert_same(params, loaded)


def test_load_casts_dtype(tmp_path):
  config, params = _params()
  checkpoint.save(tmp_path / "ckpt", config, params)
  _, bf16 = checkpoint.load(tmp_path / "ckpt", dtype=jnp.bfloat16)
  for leaf in jax.tree.leaves(bf16):
    assert leaf.dtype == jnp.bfloat16
  _, back = checkpoint.load(tmp_path / "ckpt", dtype=jnp.float32)
  np.testing.assert_array_equal(np.asarray(bf16["embed"]["embedding"]).astype(np.float32),
                                np.asarray(params["embed"]["embedding"]).astype(ml_dtypes.bfloat16).astype(np.float32))
  assert back["embed"]["embedding"].dtype == jnp.float32


def test_load_accepts_flat_and_nested_shardings_on_one_device(tmp_path):
  config, params = _params()
  checkpoint.save(tmp_path / "ckpt", config, params)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  _, a = checkpoint.load(tmp_path / "ckpt", shardings={"blocks.attn.q.kernel": device})
  _, b = checkpoint.load(tmp_path / "ckpt", shardings={"blocks": {"attn": {"q": {"kernel": device}}}})
  _, c = checkpoint.load(tmp_path / "ckpt", shardings=device)
  for loaded in (a, b, c):
    _assert_same(params, loaded)
  with pytest.raises(checkpoint.CheckpointError, match="blocks.attn.nope"):
    checkpoint.load(tmp_path / "ckpt", shardings={"blocks.attn.nope": device})


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices (tests/conftest.py sets 8 CPU devices)")
def test_load_places_slices_on_a_device_mesh(tmp_path):
  """Each device holds only its slice of a sharded tensor; values equal the unsharded load."""
  config, params = _params()
  checkpoint.save(tmp_path / "ckpt", config, params)
  mesh = jax.make_mesh((4,), ("model",), devices=jax.devices()[:4])
  shardings = {"blocks.mlp.gate.kernel": NamedSharding(mesh, P(None, None, "model")),
               "embed": {"embedding": NamedSharding(mesh, P("model", None))}}
  _, sharded = checkpoint.load(tmp_path / "ckpt", shardings=shardings)
  gate = sharded["blocks"]["mlp"]["gate"]["kernel"]
  assert {s.data.shape for s in gate.addressable_shards} == {(gate.shape[0], gate.shape[1], gate.shape[2] // 4)}
  assert len(gate.addressable_shards) == 4
  embedding = sharded["embed"]["embedding"]
  assert {s.data.shape for s in embedding.addressable_shards} == {(embedding.shape[0] // 4, embedding.shape[1])}
  _assert_same(params, sharded)


def test_writer_blocks_columns_and_coverage(tmp_path):
  rng = np.random.default_rng(0)
  full = rng.standard_normal((3, 5, 7)).astype(np.float32)
  torch_layout = np.ascontiguousarray(full.transpose(0, 2, 1))  # [L, out, in] per layer
  with checkpoint.SafetensorsWriter(tmp_path, {"a": ((3, 5, 7), np.float32), "b": ((3, 5, 7), np.float32)}) as w:
    for layer in range(3):
      w.write("a", full[layer, :2][None][0], at=(layer, 0))
      w.write("a", full[layer, 2:], at=(layer, 2))
      for r0 in range(0, 7, 3):  # rows of the torch weight are columns of ours
        w.write_columns("b", torch_layout[layer, r0:r0 + 3].T, (layer,), r0)
  from safetensors.numpy import load_file
  loaded = load_file(tmp_path / "model.safetensors")
  np.testing.assert_array_equal(loaded["a"], full)
  np.testing.assert_array_equal(loaded["b"], full)


def test_writer_rejects_incomplete_and_misplaced_writes(tmp_path):
  with pytest.raises(checkpoint.CheckpointError, match="tensor b received 0 bytes"):
    with checkpoint.SafetensorsWriter(tmp_path, {"a": ((2,), np.float32), "b": ((2,), np.float32)}) as w:
      w.write("a", np.zeros(2, np.float32))
  with pytest.raises(checkpoint.CheckpointError, match="does not fit tensor a"):
    with checkpoint.SafetensorsWriter(tmp_path, {"a": ((2, 3), np.float32)}) as w:
      w.write("a", np.zeros((2, 3), np.float32), at=(1,))
  with pytest.raises(checkpoint.CheckpointError, match="tensor a is float32"):
    with checkpoint.SafetensorsWriter(tmp_path, {"a": ((2,), np.float32)}) as w:
      w.write("a", np.zeros(2, np.float64))


def test_save_refuses_non_empty_dir_and_is_atomic(tmp_path):
  config, params = _params()
  target = tmp_path / "ckpt"
  target.mkdir()
  (target / "keep.txt").write_text("precious")
  with pytest.raises(checkpoint.CheckpointError, match="not empty.*overwrite"):
    checkpoint.save(target, config, params)
  assert os.listdir(target) == ["keep.txt"]
  bad = dict(params, final_norm={"weight": jnp.ones((3,))})
  with pytest.raises(checkpoint.CheckpointError, match="final_norm.weight has shape"):
    checkpoint.save(tmp_path / "other", config, bad)
  assert not (tmp_path / "other").exists()
  checkpoint.save(target, config, params, overwrite=True)
  assert "keep.txt" not in os.listdir(target)
  assert [p for p in os.listdir(tmp_path) if p.startswith(".")] == []  # no temporary directories left


def test_atomic_output_dir_cleans_up_on_error(tmp_path):
  with pytest.raises(RuntimeError):
    with checkpoint.atomic_output_dir(tmp_path / "out") as tmp:
      open(os.path.join(tmp, "partial"), "w").close()
      raise RuntimeError("boom")
  assert os.listdir(tmp_path) == []


class TestLoadErrors:

  @pytest.fixture
  def good(self):
    config, params = _params()
    return config, _flat_numpy(params)

  def test_missing_tensor(self, tmp_path, good):
    config, flat = good
    del flat["blocks.mlp.up.kernel"]
    _write_raw(tmp_path, config, flat)
    with pytest.raises(checkpoint.CheckpointError, match=r"missing tensors blocks\.mlp\.up\.kernel"):
      checkpoint.load(tmp_path)

  def test_unexpected_tensor(self, tmp_path, good):
    config, flat = good
    flat["blocks.attn.extra"] = np.zeros((2, 3), np.float32)
    _write_raw(tmp_path, config, flat)
    with pytest.raises(checkpoint.CheckpointError, match=r"unexpected tensors blocks\.attn\.extra"):
      checkpoint.load(tmp_path)

  def test_wrong_shape(self, tmp_path, good):
    config, flat = good
    flat["final_norm.weight"] = np.ones((config.d_model + 1,), np.float32)
    _write_raw(tmp_path, config, flat)
    with pytest.raises(checkpoint.CheckpointError, match=rf"final_norm.weight has shape \[{config.d_model + 1}\]; "
                       rf"expected \[{config.d_model}\]"):
      checkpoint.load(tmp_path)

  def test_wrong_dtype(self, tmp_path, good):
    config, flat = good
    flat["final_norm.weight"] = flat["final_norm.weight"].astype(np.int32)
    _write_raw(tmp_path, config, flat)
    with pytest.raises(checkpoint.CheckpointError, match="final_norm.weight has dtype I32; expected a floating"):
      checkpoint.load(tmp_path)

  def test_truncated_file(self, tmp_path, good):
    config, flat = good
    _write_raw(tmp_path, config, flat)
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-64])
    with pytest.raises(checkpoint.CheckpointError, match="model.safetensors.*truncated or corrupted"):
      checkpoint.load(tmp_path)

  def test_corrupted_header(self, tmp_path, good):
    config, flat = good
    _write_raw(tmp_path, config, flat)
    path = tmp_path / "model.safetensors"
    raw = bytearray(path.read_bytes())
    raw[8:16] = b"\x00garbag"
    path.write_bytes(bytes(raw))
    with pytest.raises(checkpoint.CheckpointError, match="model.safetensors"):
      checkpoint.load(tmp_path)

  def test_config_missing_field(self, tmp_path, good):
    config, flat = good
    _write_raw(tmp_path, config, flat)
    values = json.loads((tmp_path / "config.json").read_text())
    del values["d_model"]
    (tmp_path / "config.json").write_text(json.dumps(values))
    with pytest.raises(ConfigError, match="d_model"):
      checkpoint.load(tmp_path)

  def test_missing_config_and_weights(self, tmp_path, good):
    with pytest.raises(checkpoint.CheckpointError, match="config.json not found"):
      checkpoint.load(tmp_path)
    checkpoint.write_config(tmp_path, good[0])
    with pytest.raises(checkpoint.CheckpointError, match="neither model.safetensors nor"):
      checkpoint.load(tmp_path)

  def test_index_names_a_missing_file(self, tmp_path, good):
    config, flat = good
    _write_raw(tmp_path, config, flat)
    weight_map = {n: "model.safetensors" for n in flat}
    weight_map["embed.embedding"] = "model-00002-of-00002.safetensors"
    (tmp_path / checkpoint.INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(checkpoint.CheckpointError, match="embed.embedding is in model-00002-of-00002.safetensors"):
      checkpoint.load(tmp_path)


def test_train_state_roundtrip(tmp_path):
  config, params = _params()
  state = {"params": params, "opt": {"mu": jax.tree.map(jnp.zeros_like, params)}, "count": jnp.int32(7)}
  checkpoint.save_train_state(tmp_path / "train", 10, state)
  state20 = jax.tree.map(lambda x: x + 1, state)
  checkpoint.save_train_state(tmp_path / "train", 20, state20)
  abstract = jax.eval_shape(lambda: state)
  step, restored = checkpoint.restore_train_state(tmp_path / "train", abstract)
  assert step == 20
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state20)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  step, restored = checkpoint.restore_train_state(tmp_path / "train", abstract, step=10)
  assert step == 10 and int(restored["count"]) == 7
  with pytest.raises(checkpoint.CheckpointError, match="No training checkpoint"):
    checkpoint.restore_train_state(tmp_path / "empty", abstract)


def test_load_by_embedded_name(tmp_path, monkeypatch):
  """"tiny-dlm" loads the packaged model (tensors equal to its safetensors file read here), unless a
  directory of that name exists in the working directory, which then wins."""
  from safetensors.numpy import load_file  # pylint: disable=import-outside-toplevel
  import dlm_jax  # pylint: disable=import-outside-toplevel
  packaged = os.path.join(os.path.dirname(dlm_jax.__file__), "default_models", "tiny-dlm")
  monkeypatch.chdir(tmp_path)
  config, params = checkpoint.load("tiny-dlm")
  assert config.name == "tiny-dlm"
  stored = load_file(os.path.join(packaged, "model.safetensors"))
  loaded = _flat_numpy(params)
  assert sorted(loaded) == sorted(stored)
  for name, value in stored.items():
    np.testing.assert_array_equal(loaded[name], value, err_msg=name)
  local_config, local_params = _params("tiny-llada")
  checkpoint.save(tmp_path / "tiny-dlm", local_config, local_params)
  assert checkpoint.load("tiny-dlm")[0] == local_config
  with pytest.raises(checkpoint.CheckpointError, match="tiny-nonexistent"):
    checkpoint.load("tiny-nonexistent")
