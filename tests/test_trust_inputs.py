"""Inputs read with suspicion: shard names confined to the checkpoint, safetensors headers checked like the
safetensors library does, absurd config sizes and flag values refused before allocation, every JSON file
decoded and type-checked with the file named, task files validated before model work, non-finite weights
and outputs refused."""

import json
import os
import re
import shutil
import struct
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from converters.hf_convert import convert
from converters.safetensors_io import read_header
from dlm_jax import model
from dlm_jax.io import checkpoint
from dlm_jax.config import ConfigError, ModelConfig, preset
from dlm_jax.io.errors import CheckpointError
from dlm_jax.session import SessionError, decode_settings, size_limits, training_record
from experiments.common import items, run_dir
from experiments.common.cli import UserError
from experiments.forward import forward_with_attention, nonfinite_message

try:
  from tests import experiments_fixtures as fx
  from tests.test_trust_files import _llama_dir
except ImportError:
  import experiments_fixtures as fx
  from test_trust_files import _llama_dir


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  """A converted tiny-llada checkpoint (3 layers), its config and float32 params."""
  config = preset("tiny-llada").replace(n_layers=3)
  params = jax.device_get(model.init_params(config, jax.random.key(0), jnp.float32))
  directory = str(tmp_path_factory.mktemp("tiny") / "ckpt")
  checkpoint.save(directory, config, params)
  return directory, config, params


def _copy(tiny, tmp_path) -> str:
  target = str(tmp_path / "ckpt")
  shutil.copytree(tiny[0], target)
  return target


# -------------------------------------------------------------------------------------------------------
# Shards outside the checkpoint.


@pytest.mark.parametrize("entry", ["../elsewhere/model.safetensors", "ABSOLUTE", "link"])
def test_loader_refuses_shards_outside_the_checkpoint(tiny, tmp_path, entry):
  directory = _copy(tiny, tmp_path)
  elsewhere = tmp_path / "elsewhere"
  elsewhere.mkdir()
  shutil.move(os.path.join(directory, "model.safetensors"), elsewhere / "model.safetensors")
  if entry == "link":
    os.symlink(elsewhere / "model.safetensors", os.path.join(directory, "model.safetensors"))
  else:
    name = str(elsewhere / "model.safetensors") if entry == "ABSOLUTE" else entry
    names = checkpoint.expected_tensors(tiny[1])
    with open(os.path.join(directory, checkpoint.INDEX_FILE), "w") as f:
      json.dump({"weight_map": {n: name for n in names}}, f)
  with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
    checkpoint.load(directory)


def test_converter_refuses_index_entries_leaving_the_directory(tmp_path):
  hf = _llama_dir(tmp_path / "hf")
  os.makedirs(tmp_path / "elsewhere")
  shutil.move(os.path.join(hf, "model.safetensors"), tmp_path / "elsewhere" / "model.safetensors")
  with open(os.path.join(hf, checkpoint.INDEX_FILE), "w") as f:
    json.dump({"weight_map": {"model.norm.weight": "../elsewhere/model.safetensors"}}, f)
  with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
    convert(hf, str(tmp_path / "out"))
  assert not (tmp_path / "out").exists()


# -------------------------------------------------------------------------------------------------------
# Safetensors headers.


def _safetensors(path, header: dict, data_bytes: int) -> str:
  blob = json.dumps(header).encode() if isinstance(header, dict) else header
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(blob)) + blob + b"\0" * data_bytes)
  return str(path)


@pytest.mark.parametrize("header, message", [
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, "share bytes"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, "share bytes"),
    (b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, '
     b'"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}', "'a' appears twice"),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}, "ends at data byte 24"),
    ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, "needs 12 bytes"),
    ({"a": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, "header entry for tensor a"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}}, "data_offsets"),
    (b'["not", "an", "object"]', "must hold a JSON object"),
])
def test_safetensors_header_checks(tmp_path, header, message):
  path = _safetensors(tmp_path / "x.safetensors", header, 16)
  with pytest.raises(CheckpointError, match=message):
    read_header(path)


def test_safetensors_valid_header_is_read(tmp_path):
  path = _safetensors(tmp_path / "x.safetensors", {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                                   "b": {"dtype": "F16", "shape": [4], "data_offsets": [8, 16]}}, 16)
  infos = read_header(path)
  assert [(n, i.shape, i.end - i.begin) for n, i in sorted(infos.items())] == [("a", (2,), 8), ("b", (4,), 8)]


# -------------------------------------------------------------------------------------------------------
# Sizes.


@pytest.mark.parametrize("change, field", [
    ({"num_hidden_layers": 10**9}, "n_layers"), ({"vocab_size": 10**12}, "vocab_size"),
    ({"hidden_size": 2**20, "num_attention_heads": 2**10, "num_key_value_heads": 2**10}, "d_model"),
    ({"num_hidden_layers": 4000, "hidden_size": 65536, "num_attention_heads": 512, "num_key_value_heads": 512,
      "intermediate_size": 2**19}, "parameters"),
])
def test_absurd_hf_config_refused_before_allocation(tmp_path, change, field):
  hf = _llama_dir(tmp_path / "hf")
  with open(os.path.join(hf, "config.json")) as f:
    config = json.load(f)
  with open(os.path.join(hf, "config.json"), "w") as f:
    json.dump(config | change, f)
  start = time.perf_counter()
  with pytest.raises(ConfigError, match=f"{field}.*limit"):
    convert(hf, str(tmp_path / "out"))
  assert time.perf_counter() - start < 5
  assert not (tmp_path / "out").exists()


def test_parameter_estimate_matches_the_model_for_a_dense_config():
  from dlm_jax.config import limits as config_limits
  config = preset("tiny-llama").replace(n_layers=3, d_model=48, mlp_hidden=80, vocab_size=100)
  exact = model.param_count(config)
  norms = (2 * config.n_layers + 1) * config.d_model  # left out by the estimate
  assert config_limits.estimated_params(config) == exact - norms


def test_flag_sizes_refused():
  for name, value in (("gen_length", 10**9), ("steps", 10**9), ("batch_size", 10**6), ("n_items", 10**9)):
    with pytest.raises(SessionError, match=f"--{name}={value}: above the limit"):
      size_limits.check(**{name: value})
  size_limits.check(gen_length=size_limits.MAX_SEQUENCE, steps=None)
  with pytest.raises(SessionError, match="--gen_length=1000000000"):
    decode_settings.DecodeSettings(gen_length=10**9)
  with pytest.raises(SessionError, match="positions, above the limit"):
    size_limits.check_sequence(100, size_limits.MAX_SEQUENCE, 50)
  with pytest.raises(SessionError, match="logits is above the limit"):
    size_limits.check_sequence(10, 100_000, 126464, batch=2)


def test_generate_and_forward_refuse_in_one_line(tiny, tmp_path):
  """Sizes refused before allocation (fast, no traceback), and non-finite weights refused at load."""
  nan_dir = _copy(tiny, tmp_path)
  config, params = tiny[1], jax.tree.map(np.array, tiny[2])
  params["blocks"]["attn"]["q"]["kernel"][2, 0, 0] = np.nan
  checkpoint.save(nan_dir, config, params, overwrite=True)
  out = str(tmp_path / "o.json")
  base = [f"--checkpoint={tiny[0]}", "--prompt_ids=1,2,3", f"--json_out={out}"]
  cases = [base + ["--gen_length=1000000000"], base + ["--steps=1000000000"],
           base + ["--gen_length=131072", "--block_length=131072", "--steps=131072"],
           [f"--checkpoint={nan_dir}", "--prompt_ids=1,2,3", f"--json_out={out}", "--gen_length=4", "--steps=4",
            "--block_length=4"]]
  start = time.perf_counter()
  results = fx.run_cases("generate", cases)
  assert time.perf_counter() - start < 120
  words = [["--gen_length=1000000000", "limit"], ["--steps=1000000000", "limit"], ["131075 positions", "limit"],
           ["blocks.attn.q.kernel", "layer 2", "non-finite"]]
  for (code, stderr), must in zip(results, words):
    lines = stderr.strip().splitlines()
    assert code == 1 and len(lines) == 1 and "Traceback" not in stderr, stderr
    assert all(w in lines[0] for w in must), (lines[0], must)
  assert not os.path.exists(out)


# -------------------------------------------------------------------------------------------------------
# Non-finite weights and outputs.


def test_load_names_the_first_non_finite_tensor_and_layer(tiny, tmp_path):
  directory = _copy(tiny, tmp_path)
  config, params = tiny[1], jax.tree.map(np.array, tiny[2])
  params["blocks"]["mlp"]["down"]["kernel"][1, 3, 0] = np.inf
  params["final_norm"]["weight"][0] = np.nan
  checkpoint.save(directory, config, params, overwrite=True)
  with pytest.raises(CheckpointError, match=r"blocks\.mlp\.down\.kernel holds non-finite .* in layer 1 \(1 more"):
    checkpoint.load(directory)
  _, loaded = checkpoint.load(directory, check_finite=False)
  assert np.isinf(np.asarray(loaded["blocks"]["mlp"]["down"]["kernel"])[1, 3, 0])
  checkpoint.load(tiny[0])  # finite weights load


def test_forward_outputs_name_where_non_finite_values_start(tiny):
  config, params = tiny[1], jax.tree.map(np.array, tiny[2])
  logits, incoming = forward_with_attention(config, params, [1, 2, 3])
  assert nonfinite_message(logits, incoming) is None
  params["blocks"]["mlp"]["up"]["kernel"][1] = np.inf  # layer 1's feed-forward is not finite: layer 2 sees it
  logits, incoming = forward_with_attention(config, params, [1, 2, 3])
  message = nonfinite_message(logits, incoming)
  assert message.startswith(f"{logits.size} of {logits.size} logits") and "layer 2's attention" in message
  params = jax.tree.map(np.array, tiny[2])
  params["lm_head"]["kernel"][0, 0] = np.nan
  logits, incoming = forward_with_attention(config, params, [1, 2, 3])
  assert "final norm or the LM head" in nonfinite_message(logits, incoming)
  assert nonfinite_message(logits, incoming).startswith(f"3 of {logits.size}")


# -------------------------------------------------------------------------------------------------------
# JSON files decoded and type-checked, the file named.


@pytest.mark.parametrize("content, message", [
    (b'{"d_model": "\xff"}', "is not valid UTF-8 text"), (b"[1, 2]", "must hold a JSON object, got a JSON array"),
    (b'{"a": 1, "a": 2}', "is not valid: key 'a' appears twice"), (b"{oops", "is not valid JSON")])
def test_json_files_named_in_errors(tiny, tmp_path, content, message):
  directory = _copy(tiny, tmp_path)
  path = os.path.join(directory, "config.json")
  with open(path, "wb") as f:
    f.write(content)
  with pytest.raises(CheckpointError, match=f"{path} {message}"):
    checkpoint.read_config(directory)
  hf = _llama_dir(tmp_path / "hf")
  with open(os.path.join(hf, "config.json"), "wb") as f:
    f.write(content)
  with pytest.raises(ConfigError, match=f"config.json {message}"):
    convert(hf, str(tmp_path / "out"))
  run = tmp_path / "run"
  run.mkdir()
  (run / "run.json").write_bytes(content)
  with pytest.raises(UserError, match=f"run.json {message}"):
    run_dir.RunDir(str(run), {"a": 1})
  (tmp_path / "ckpt" / "training.json").write_bytes(content)
  with pytest.raises(SessionError, match=f"training.json {message}"):
    training_record.read(directory)


def test_wrong_field_types_refused(tiny, tmp_path):
  directory = _copy(tiny, tmp_path)
  values = json.loads(open(os.path.join(directory, "config.json")).read())
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(values | {"n_layers": "3"}, f)
  with pytest.raises(ConfigError, match=r"config\.json: ModelConfig\.n_layers must be a positive integer"):
    checkpoint.read_config(directory)
  with pytest.raises(ConfigError, match="n_layers = 5000 is above the limit"):
    ModelConfig.from_dict(values | {"n_layers": 5000})
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    f.write("[]")
  from dlm_jax.io.tokenizer import _added_tokens
  with pytest.raises(CheckpointError, match="tokenizer_config.json must hold a JSON object"):
    _added_tokens(directory)


# -------------------------------------------------------------------------------------------------------
# Task files validated whole, before any model work.


@pytest.mark.parametrize("lines, where, message", [
    ([b'{"question": "a", "answer": "#### 1"}', b'', b'{"question": "b", "answer": "no number"}'], ":3 (item 1)",
     "no '#### n' line"),
    ([b'{"question": "a", "answer": "#### 1"}', b'{"question": "b\xff", "answer": "#### 2"}'], ":2 (item 1)",
     "not valid UTF-8"),
    ([b'["question", "answer"]'], ":1 (item 0)", "must hold a JSON object"),
    ([b'{"question": 5, "answer": "#### 5"}'], ":1 (item 0)", "field 'question' is an integer; expected a string"),
    ([b'{"question": "a"}'], ":1 (item 0)", "field 'answer' is missing"),
])
def test_gsm8k_task_validated_up_front(tmp_path, lines, where, message):
  path = tmp_path / "task.jsonl"
  path.write_bytes(b"\n".join(lines) + b"\n")
  with pytest.raises(UserError, match=f"task.jsonl{re.escape(where)}.*{re.escape(message)}"):
    items.TaskSettings(task=str(path))


def test_valid_gsm8k_task_loads(tmp_path):
  path = tmp_path / "task.jsonl"
  path.write_text('{"question": "a", "answer": "x #### 1"}\n\n{"question": "b", "answer": "#### 2"}\n')
  loaded = items.load_items(str(path), 0, 0)
  assert [(i.id, i.question, i.target) for i in loaded] == [("0", "a", "x #### 1"), ("1", "b", "#### 2")]


def test_device_and_host_paths_agree():
  """The compiled reduction (used for arrays on accelerators) finds what NumPy finds, on CPU here."""
  from dlm_jax.io import finite
  arrays = {"scalar": np.float32(np.nan), "vector": np.array([1, 2, np.inf], np.float32),
            "stacked": np.zeros((4, 3, 2), np.float32), "clean": np.ones((2, 2), np.float32)}
  arrays["stacked"][2, 1, 0] = -np.inf
  arrays["stacked"][3, 0, 1] = np.nan
  device = {name: (bool(bad), int(index)) for name, (bad, index) in
            jax.device_get(finite._scan({n: jnp.asarray(x) for n, x in arrays.items()})).items()}  # pylint: disable=protected-access
  assert device == {"scalar": (True, 0), "vector": (True, 2), "stacked": (True, 2), "clean": (False, 0)}
  assert finite.first_nonfinite(arrays) == {"scalar": 0, "stacked": 2, "vector": 2}


def test_humaneval_problems_checked_up_front(monkeypatch):
  from dlm_jax.tasks import humaneval
  monkeypatch.setattr(humaneval, "load_problems",
                      lambda: {"HumanEval/0": {"task_id": "HumanEval/0", "prompt": "def f():", "entry_point": "f"}})
  with pytest.raises(UserError, match="problem HumanEval/0: field 'test' is missing"):
    items.TaskSettings(task="humaneval")
