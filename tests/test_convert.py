"""HF-format fixtures of every family -> converters -> dlm_jax.io.checkpoint.load -> forward == the original model."""

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open

from converters.hf_convert import convert
from dlm_jax.io import checkpoint
from dlm_jax.model import CallInstruments, forward
from dlm_jax.instrument.stats import StatsSpec

try:
  from tests import hf_fixtures
except ImportError:
  import hf_fixtures

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENS = [0, 5, 17, 33, 2, 60, 91, 7, 7, 12, 44]
TOLERANCE = 1e-4

VARIANTS = {
    "mha": dict(heads=4, kv_heads=4),
    "gqa_tied_3shards": dict(heads=6, kv_heads=2, tied=True, shards=3, layers=3),
    "mqa_bf16": dict(heads=4, kv_heads=1, storage="bfloat16", hidden=64, intermediate=96),
}


def our_outputs(directory, token_ids):
  """Logits [S, V] and incoming attention [L, N, S] of a converted checkpoint, float32."""
  config, params = checkpoint.load(directory, dtype=jnp.float32)
  out = forward(params, jnp.asarray([token_ids]), config=config,
                instruments=CallInstruments(stats_spec=StatsSpec(incoming_attention=True)))
  return config, np.asarray(out.logits[0]), np.asarray(out.incoming_attention[:, 0, 0])  # [L, B, Q, N, S]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("family", hf_fixtures.FAMILIES)
def test_family_matches_transformers(tmp_path, family, variant):
  spec = hf_fixtures.Spec(family, **VARIANTS[variant])
  model = hf_fixtures.build(spec, str(tmp_path / "hf"))
  config = convert(str(tmp_path / "hf"), str(tmp_path / "out"), arch="auto", dtype="float32")
  loaded_config, logits, incoming = our_outputs(tmp_path / "out", TOKENS)
  assert loaded_config == config
  assert config.causal == (not spec.bidirectional)
  assert config.logit_shift == (0 if family in ("llada", "mmada") else 1)
  assert config.tied_embeddings == spec.tied and config.n_kv_heads == spec.kv_heads
  ref_logits, ref_incoming = hf_fixtures.reference_outputs(model, TOKENS, spec.bidirectional)
  np.testing.assert_allclose(logits, ref_logits, atol=TOLERANCE, rtol=0)
  np.testing.assert_allclose(incoming, ref_incoming, atol=TOLERANCE, rtol=0)
  if spec.bidirectional:  # the reference really is bidirectional: the causal model differs
    causal_logits, _ = hf_fixtures.reference_outputs(model, TOKENS, bidirectional=False)
    assert np.abs(causal_logits - ref_logits).max() > 1e-2
  assert (tmp_path / "out" / "tokenizer.json").read_text() == (tmp_path / "hf" / "tokenizer.json").read_text()


def test_llada_qkv_bias_from_qwen2_weights(tmp_path):
  """include_qkv_bias: LLaDA names with q/k/v biases (built from a Qwen2 model)."""
  spec = hf_fixtures.Spec("llada", qkv_bias=True, kv_heads=2)
  model = hf_fixtures.build(spec, str(tmp_path / "hf"))
  config = convert(str(tmp_path / "hf"), str(tmp_path / "out"))
  assert config.qkv_bias
  _, logits, _ = our_outputs(tmp_path / "out", TOKENS)
  np.testing.assert_allclose(logits, hf_fixtures.reference_outputs(model, TOKENS, True)[0], atol=TOLERANCE, rtol=0)


def test_llada_config_mapping(tmp_path):
  spec = hf_fixtures.Spec("mmada", vocab=130000, hidden=16, heads=2, kv_heads=2, intermediate=16, layers=1)
  hf_fixtures.build(spec, str(tmp_path / "hf"))
  values = json.loads((tmp_path / "hf" / "config.json").read_text())
  values.update(n_kv_heads=None, embedding_size=130048, mask_token_id=None, eos_token_id=None, pad_token_id=None)
  (tmp_path / "hf" / "config.json").write_text(json.dumps(values))
  with pytest.raises(checkpoint.CheckpointError, match=r"has shape \[130000, 16\]; expected \[130048, 16\]"):
    convert(str(tmp_path / "hf"), str(tmp_path / "out"))  # embedding_size wins over vocab_size
  values["embedding_size"] = 130000
  (tmp_path / "hf" / "config.json").write_text(json.dumps(values))
  config = convert(str(tmp_path / "hf"), str(tmp_path / "out"))
  assert (config.n_kv_heads, config.vocab_size, config.rope_fp32) == (2, 130000, True)
  assert (config.mask_token_id, config.eos_token_id, config.pad_token_id) == (126336, 126081, 126081)
  assert (config.bos_token_id, config.eot_token_id) == (126080, 126348)


def test_architectures_only_and_legacy_rope_fields(tmp_path):
  """`auto` falls back to `architectures`; transformers-4 style rope_theta / rope_scaling: null is read."""
  spec = hf_fixtures.Spec("llama", rope_theta=5000.0)
  model = hf_fixtures.build(spec, str(tmp_path / "hf"))
  values = json.loads((tmp_path / "hf" / "config.json").read_text())
  del values["model_type"], values["rope_parameters"]
  values.update(rope_theta=5000.0, rope_scaling=None, eos_token_id=[1, 3])
  (tmp_path / "hf" / "config.json").write_text(json.dumps(values))
  config = convert(str(tmp_path / "hf"), str(tmp_path / "out"))
  assert (config.rope_theta, config.eos_token_id, config.eot_token_id) == (5000.0, 1, 3)
  _, logits, _ = our_outputs(tmp_path / "out", TOKENS)
  np.testing.assert_allclose(logits, hf_fixtures.reference_outputs(model, TOKENS, False)[0], atol=TOLERANCE, rtol=0)


def test_streaming_block_size_and_output_shards_do_not_change_the_result(tmp_path):
  spec = hf_fixtures.Spec("dream", shards=2, storage="bfloat16")
  hf_fixtures.build(spec, str(tmp_path / "hf"))
  convert(str(tmp_path / "hf"), str(tmp_path / "whole"))
  convert(str(tmp_path / "hf"), str(tmp_path / "rows"), chunk_bytes=1, max_shard_bytes=20_000)
  assert len([f for f in os.listdir(tmp_path / "rows") if f.endswith(".safetensors")]) > 2
  assert (tmp_path / "rows" / checkpoint.INDEX_FILE).exists()
  _, whole = checkpoint.load(tmp_path / "whole")
  _, rows = checkpoint.load(tmp_path / "rows")
  for name in checkpoint.expected_tensors(checkpoint.read_config(tmp_path / "whole")):
    a, b = whole, rows
    for part in name.split("."):
      a, b = a[part], b[part]
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


def test_dtype_choice(tmp_path):
  spec = hf_fixtures.Spec("qwen2", storage="bfloat16")
  hf_fixtures.build(spec, str(tmp_path / "hf"))
  convert(str(tmp_path / "hf"), str(tmp_path / "auto"))
  convert(str(tmp_path / "hf"), str(tmp_path / "f32"), dtype="float32")
  for name, want in (("auto", "BF16"), ("f32", "F32")):
    with safe_open(str(tmp_path / name / "model.safetensors"), framework="numpy") as f:
      assert {f.get_slice(k).get_dtype() for k in f.keys()} == {want}
  _, a = checkpoint.load(tmp_path / "auto", dtype=jnp.float32)
  _, b = checkpoint.load(tmp_path / "f32")
  bias_a, bias_b = a["blocks"]["attn"]["q"]["bias"], b["blocks"]["attn"]["q"]["bias"]
  np.testing.assert_array_equal(np.asarray(bias_a), np.asarray(bias_b))


def test_cli_convert_then_forward(tmp_path):
  """The two binaries end to end: converters.convert and experiments.forward (.npz logits and attention)."""
  spec = hf_fixtures.Spec("llada", heads=6, kv_heads=3, shards=2, layers=3)
  model = hf_fixtures.build(spec, str(tmp_path / "hf"))
  run = lambda *args: subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True,
                                     timeout=600)
  result = run("converters.convert", "--arch=llada", f"--hf_dir={tmp_path / 'hf'}", f"--out_dir={tmp_path / 'out'}",
               "--dtype=float32")
  assert result.returncode == 0, result.stderr[-3000:]
  assert "blocks.mlp.down.kernel" in result.stderr  # one progress line per tensor
  ids = ",".join(map(str, TOKENS))
  result = run("experiments.forward", f"--checkpoint={tmp_path / 'out'}", f"--token_ids={ids}",
               f"--out={tmp_path / 'fwd.npz'}")
  assert result.returncode == 0, result.stderr[-3000:]
  data = np.load(tmp_path / "fwd.npz")
  assert data["logits"].dtype == np.float32 and data["logits"].shape == (len(TOKENS), spec.vocab)
  assert data["incoming_attention"].shape == (spec.layers, spec.heads, len(TOKENS))
  np.testing.assert_allclose(data["incoming_attention"].sum(-1), len(TOKENS), rtol=1e-5)
  ref_logits, ref_incoming = hf_fixtures.reference_outputs(model, TOKENS, bidirectional=True)
  np.testing.assert_allclose(data["logits"], ref_logits, atol=TOLERANCE, rtol=0)
  np.testing.assert_allclose(data["incoming_attention"], ref_incoming, atol=TOLERANCE, rtol=0)
  result = run("experiments.forward", f"--checkpoint={tmp_path / 'out'}", f"--token_ids=1,{spec.vocab}",
               f"--out={tmp_path / 'bad.npz'}")
  assert result.returncode == 1 and f"token id {spec.vocab} is outside the vocabulary" in result.stderr
  assert not (tmp_path / "bad.npz").exists()


def test_tied_checkpoint_with_a_stored_head_copy_and_foreign_token_ids(tmp_path):
  """A tied model that still stores its head converts (the copy is ignored, as in transformers); special
  token ids outside a shrunken vocabulary are dropped with a warning instead of failing the conversion."""
  spec = hf_fixtures.Spec("llada", tied=True)
  model = hf_fixtures.reference_model(spec)
  tensors = hf_fixtures.hf_tensors(spec, model)
  tensors["model.transformer.ff_out.weight"] = tensors["model.transformer.wte.weight"].clone()
  config = hf_fixtures._family_config(spec, model)  # pylint: disable=protected-access
  config.update(mask_token_id=126336, eos_token_id=126081)
  hf_fixtures.write_checkpoint(str(tmp_path / "hf"), config, tensors)
  converted = convert(str(tmp_path / "hf"), str(tmp_path / "out"))
  assert converted.tied_embeddings and converted.mask_token_id is None and converted.eos_token_id is None
  _, logits, _ = our_outputs(tmp_path / "out", TOKENS)
  np.testing.assert_allclose(logits, hf_fixtures.reference_outputs(model, TOKENS, True)[0], atol=TOLERANCE, rtol=0)
