"""Bad input to the converter: a clear error naming the tensor or field, and no output directory left behind."""

import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from converters import hf_convert, plan
from converters.hf_convert import convert
from dlm_jax.io.checkpoint import CheckpointError
from dlm_jax.config import ConfigError

try:
  from tests import hf_fixtures
except ImportError:
  import hf_fixtures

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def models():
  """One reference model per family (built once; each test writes its own fixture files)."""
  return {family: hf_fixtures.reference_model(hf_fixtures.Spec(family)) for family in ("llada", "llama", "qwen2")}


def _fixture(tmp_path, models, family="llama", shards=1, edit_tensors=None, edit_config=None):
  spec = hf_fixtures.Spec(family)
  model = models[family]
  tensors = hf_fixtures.hf_tensors(spec, model)
  config = hf_fixtures._family_config(spec, model)  # pylint: disable=protected-access
  if edit_tensors:
    edit_tensors(tensors)
  if edit_config:
    edit_config(config)
  hf_dir = str(tmp_path / "hf")
  hf_fixtures.write_checkpoint(hf_dir, config, tensors, shards)
  return hf_dir


def _fails(tmp_path, hf_dir, error, pattern, **kwargs):
  out = tmp_path / "out"
  with pytest.raises(error, match=pattern):
    convert(hf_dir, str(out), **kwargs)
  assert not out.exists()
  assert [p for p in os.listdir(tmp_path) if p.startswith(".")] == []  # no temporary directory left


def test_missing_tensor(tmp_path, models):
  hf_dir = _fixture(tmp_path, models, edit_tensors=lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
  _fails(tmp_path, hf_dir, CheckpointError, r"missing tensors model\.layers\.1\.mlp\.up_proj\.weight")


def test_missing_llada_head(tmp_path, models):
  hf_dir = _fixture(tmp_path, models, "llada", edit_tensors=lambda t: t.pop("model.transformer.ff_out.weight"))
  _fails(tmp_path, hf_dir, CheckpointError, r"missing tensors model\.transformer\.ff_out\.weight")


def test_unexpected_tensor(tmp_path, models):
  def add(tensors):
    tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(12)
  hf_dir = _fixture(tmp_path, models, edit_tensors=add)
  _fails(tmp_path, hf_dir, CheckpointError, r"unexpected tensors model\.layers\.0\.self_attn\.q_norm\.weight")


def test_rotary_buffers_are_ignored(tmp_path, models):
  def add(tensors):
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(6)
  hf_dir = _fixture(tmp_path, models, edit_tensors=add)
  convert(hf_dir, str(tmp_path / "out"))


def test_wrong_shape(tmp_path, models):
  def shrink(tensors):
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 48)
  hf_dir = _fixture(tmp_path, models, edit_tensors=shrink)
  _fails(tmp_path, hf_dir, CheckpointError,
         r"model\.layers\.0\.self_attn\.k_proj\.weight has shape \[8, 48\]; expected \[24, 48\]")


def test_wrong_dtype(tmp_path, models):
  def to_int(tensors):
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.int32)
  hf_dir = _fixture(tmp_path, models, edit_tensors=to_int)
  _fails(tmp_path, hf_dir, CheckpointError, r"model\.norm\.weight has dtype I32; expected a floating dtype")


def test_truncated_safetensors(tmp_path, models):
  hf_dir = _fixture(tmp_path, models, shards=2)
  path = os.path.join(hf_dir, "model-00002-of-00002.safetensors")
  with open(path, "rb") as f:
    data = f.read()
  with open(path, "wb") as f:
    f.write(data[:-100])
  _fails(tmp_path, hf_dir, CheckpointError, r"model-00002-of-00002\.safetensors is truncated: tensor \S+ ends at")


def test_corrupted_safetensors_header(tmp_path, models):
  hf_dir = _fixture(tmp_path, models)
  path = os.path.join(hf_dir, "model.safetensors")
  with open(path, "r+b") as f:
    f.seek(8)
    f.write(b"\x00\xffnot json")
  _fails(tmp_path, hf_dir, CheckpointError, r"model\.safetensors is corrupted: its safetensors header is not valid")


def test_header_with_impossible_length(tmp_path, models):
  hf_dir = _fixture(tmp_path, models)
  with open(os.path.join(hf_dir, "model.safetensors"), "r+b") as f:
    f.write((10**12).to_bytes(8, "little"))
  _fails(tmp_path, hf_dir, CheckpointError, r"model\.safetensors is truncated or not a safetensors file")


def test_index_points_to_missing_shard(tmp_path, models):
  hf_dir = _fixture(tmp_path, models, shards=2)
  os.remove(os.path.join(hf_dir, "model-00001-of-00002.safetensors"))
  _fails(tmp_path, hf_dir, CheckpointError, r"tensor \S+ is in model-00001-of-00002\.safetensors, which does not")


def test_index_names_tensor_absent_from_its_shard(tmp_path, models):
  hf_dir = _fixture(tmp_path, models, shards=2)
  path = os.path.join(hf_dir, "model-00001-of-00002.safetensors")
  tensors = load_file(path)
  dropped = sorted(tensors)[0]
  del tensors[dropped]
  save_file(tensors, path)
  _fails(tmp_path, hf_dir, CheckpointError, rf"places tensor {dropped.replace('.', '.')} in model-00001-of-00002")


@pytest.mark.parametrize("family,field", [("llama", "hidden_size"), ("llama", "num_hidden_layers"),
                                          ("qwen2", "intermediate_size"), ("llada", "d_model"),
                                          ("llada", "mlp_hidden_size"), ("llada", "weight_tying")])
def test_config_missing_field(tmp_path, models, family, field):
  hf_dir = _fixture(tmp_path, models, family, edit_config=lambda c: c.pop(field))
  _fails(tmp_path, hf_dir, ConfigError, rf"missing required field '{field}'")


def test_config_missing_rope_theta(tmp_path, models):
  def drop(config):
    config.pop("rope_parameters")
    config.pop("rope_theta", None)
  hf_dir = _fixture(tmp_path, models, edit_config=drop)
  _fails(tmp_path, hf_dir, ConfigError, r"missing required field 'rope_theta'")


@pytest.mark.parametrize("family,field,value,pattern", [
    ("llada", "block_type", "sequential", r"field 'block_type' is 'sequential'; expected 'llama'"),
    ("llada", "include_bias", True, r"field 'include_bias' is True; expected False"),
    ("llama", "rope_scaling", {"rope_type": "llama3", "factor": 8.0},
     r"field 'rope_scaling' is .*llama3.*not supported"),
    ("llama", "rope_parameters", {"rope_type": "llama3", "rope_theta": 5e5},
     r"'rope_parameters.rope_type' is 'llama3'; expected 'default'"),
    ("llama", "hidden_act", "gelu", r"field 'hidden_act' is 'gelu'; expected 'silu'"),
    ("qwen2", "use_sliding_window", True, r"field 'use_sliding_window' is True; expected False"),
    ("llama", "num_key_value_heads", 3, r"n_heads \(4\) must be a multiple of n_kv_heads \(3\)"),
])
def test_unsupported_config_values(tmp_path, models, family, field, value, pattern):
  hf_dir = _fixture(tmp_path, models, family, edit_config=lambda c: c.update({field: value}))
  _fails(tmp_path, hf_dir, ConfigError, pattern)


def test_config_json_missing_or_invalid(tmp_path, models):
  hf_dir = _fixture(tmp_path, models)
  os.remove(os.path.join(hf_dir, "config.json"))
  _fails(tmp_path, hf_dir, CheckpointError, r"config\.json not found")
  with open(os.path.join(hf_dir, "config.json"), "w") as f:
    f.write("{not json")
  _fails(tmp_path, hf_dir, ConfigError, r"config\.json is not valid JSON")


def test_unknown_arch(tmp_path, models):
  def unknown(config):
    config.update(model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"])
  hf_dir = _fixture(tmp_path, models, edit_config=unknown)
  _fails(tmp_path, hf_dir, ConfigError, r"model_type='gpt_neox'.*expected model_type in")
  _fails(tmp_path, hf_dir, ConfigError, r"Unknown arch 'gpt2'", arch="gpt2")


def test_non_empty_out_dir_is_left_untouched(tmp_path, models):
  hf_dir = _fixture(tmp_path, models)
  out = tmp_path / "out"
  out.mkdir()
  (out / "notes.txt").write_text("keep me")
  with pytest.raises(CheckpointError, match=r"is not empty; pass --overwrite"):
    convert(hf_dir, str(out))
  assert os.listdir(out) == ["notes.txt"] and (out / "notes.txt").read_text() == "keep me"
  convert(hf_dir, str(out), overwrite=True)
  assert "notes.txt" not in os.listdir(out) and "model.safetensors" in os.listdir(out)


def test_failure_while_writing_leaves_nothing_and_keeps_old_output(tmp_path, models, monkeypatch):
  hf_dir = _fixture(tmp_path, models)
  out = tmp_path / "out"
  convert(hf_dir, str(out))
  before = sorted(os.listdir(out))

  def explode(*args, **kwargs):
    raise OSError("disk full")

  monkeypatch.setattr(hf_convert, "stream_pieces", explode)
  with pytest.raises(OSError, match="disk full"):
    convert(hf_dir, str(out), overwrite=True)
  assert sorted(os.listdir(out)) == before
  with pytest.raises(OSError, match="disk full"):
    convert(hf_dir, str(tmp_path / "fresh"))
  assert not (tmp_path / "fresh").exists()
  assert [p for p in os.listdir(tmp_path) if p.startswith(".")] == []
  assert plan.stream_pieces is not explode  # only the converter's reference was patched


def _cli(*args):
  return subprocess.run([sys.executable, "-m", "converters.convert", *args], cwd=REPO, capture_output=True,
                        text=True, timeout=300)


def test_cli_reports_errors_and_leaves_no_output(tmp_path, models):
  hf_dir = _fixture(tmp_path, models, edit_tensors=lambda t: t.pop("model.embed_tokens.weight"))
  out = tmp_path / "out"
  result = _cli(f"--hf_dir={hf_dir}", f"--out_dir={out}")
  assert result.returncode == 1
  assert "error: " in result.stderr and "missing tensors model.embed_tokens.weight" in result.stderr
  assert not out.exists()
  result = _cli("--arch=gpt2", f"--hf_dir={hf_dir}", f"--out_dir={out}")
  assert result.returncode != 0 and "--arch" in result.stderr and not out.exists()


def test_an_output_directory_that_cannot_be_created_is_one_error_and_leaves_nothing(tmp_path, models, monkeypatch):
  """A read-only parent: a CheckpointError naming the output (the CLI prints it as one line), nothing left in the
  parent. The mode bits do not stop root, so the parent's refusal is also simulated at os.mkdir."""
  hf_dir = _fixture(tmp_path, models)
  parent = tmp_path / "read_only"
  parent.mkdir()
  parent.chmod(0o555)
  real_mkdir = os.mkdir

  def refusing_mkdir(path, *args, **kwargs):
    if os.path.dirname(os.path.realpath(os.fspath(path))) == os.path.realpath(parent):
      raise PermissionError(13, "Permission denied", os.fspath(path))
    return real_mkdir(path, *args, **kwargs)

  monkeypatch.setattr(os, "mkdir", refusing_mkdir)
  try:
    with pytest.raises(CheckpointError, match=r"^Output directory .*read_only/out cannot be created: Permission "
                       "denied"):
      convert(hf_dir, str(parent / "out"))
    assert os.listdir(parent) == []
  finally:
    parent.chmod(0o755)


def test_cli_flag_errors_are_one_line(tmp_path, models):
  hf_dir = _fixture(tmp_path, models)
  out = tmp_path / "out"
  for flag, words in (("--max_shard_gb=nan", "--max_shard_gb=nan: expected a finite number"),
                      ("--chunk_mb=0", "--chunk_mb=0: expected a positive number of MiB"),
                      ("--arch=gpt2", "--arch=gpt2"), ("--out_dir= ", "is blank")):
    result = _cli(f"--hf_dir={hf_dir}", f"--out_dir={out}", flag)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1 and words in lines[0], (flag, result.stderr[-2000:])
    assert lines[0].startswith("converters.convert: error: ") and not out.exists()
