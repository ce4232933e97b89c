"""Qwen3 and its diffusion variants (dllm A2D MDLM / BD3LM, TIDE, SDAR): each tiny hub-layout checkpoint is
converted, loaded and compared on logits with transformers' Qwen3ForCausalLM under explicit 4-D masks —
bidirectional, causal and block-causal, tied and untied — and the converter reads each variant's attention,
block size and mask id from where the variant keeps them (reference/small_dlms.md)."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from converters.hf_convert import convert
from dlm_jax.io import checkpoint
from dlm_jax.config import ConfigError
from dlm_jax.model import forward
from dlm_jax.session import checkpoint_bundle

try:
  from tests import qwen3_fixtures as qf
except ImportError:
  import qwen3_fixtures as qf

T = 40  # more than one 32-block, so the BD3LM grid matters
TOKENS = np.random.default_rng(3).integers(0, qf.VOCAB, size=(2, T))
EXPECTED = {  # variant: (arch, causal, logit_shift, mask id, default sampler)
    "qwen3": ("qwen3", True, 1, None, "ar"),
    "mdlm": ("a2d-qwen3", False, 0, qf.MASK_ID, "llada"),
    "bd3lm": ("a2d-qwen3", False, 0, qf.MASK_ID, "block_diffusion"),
    "tide": ("a2d-qwen3", False, 0, qf.MASK_ID, "block_diffusion"),
    "sdar": ("sdar", False, 0, qf.MASK_ID, "block_diffusion"),
}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
  """variant -> (converted config, params, reference model, hf dir)."""
  root = tmp_path_factory.mktemp("qwen3")
  out = {}
  for seed, variant in enumerate(qf.VARIANTS):
    directory, reference = qf.build(variant, str(root / "hf"), seed=seed)
    config = convert(directory, str(root / "out" / variant), dtype="float32")
    loaded, params = checkpoint.load(str(root / "out" / variant), dtype=jnp.float32)
    assert loaded == config
    out[variant] = (config, params, reference, directory)
  return out


def _ours(params, config):
  with jax.default_matmul_precision("highest"):
    return np.asarray(forward(params, jnp.asarray(TOKENS), config=config).logits)


def _assert_close(ours, ref):
  """Within 1e-4 of the reference's largest logit."""
  np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-4 * np.abs(ref).max())


@pytest.mark.parametrize("variant", sorted(qf.VARIANTS))
def test_variant_config_matches_its_hub_declaration(converted, variant):
  config, params, _, _ = converted[variant]
  arch, causal, shift, mask, sampler = EXPECTED[variant]
  _, tied, block = qf.VARIANTS[variant]
  assert (config.causal, config.logit_shift, config.mask_token_id) == (causal, shift, mask)
  assert config.attention_block_size == block and config.tied_embeddings == tied
  assert config.qk_norm and not config.qkv_bias and config.head_dim == 16 and config.rope_theta == 1e6
  assert ("lm_head" in params) == (not tied)
  assert checkpoint_bundle.default_sampler(config) == sampler
  del arch


@pytest.mark.parametrize("variant", sorted(qf.VARIANTS))
def test_converted_logits_match_transformers_in_every_attention(converted, variant):
  """The variant's own attention, then the other two on the same weights (tied: mdlm; untied: sdar)."""
  config, params, reference, _ = converted[variant]
  own = ("causal" if config.causal else "block" if config.attention_block_size else "bidirectional")
  native = None if own == "causal" else qf.hf_mask(T, own, config.attention_block_size)
  _assert_close(_ours(params, config), qf.reference_logits(reference, TOKENS, native))
  if variant not in ("mdlm", "sdar"):
    return
  bidirectional = config.replace(causal=False, attention_block_size=None)
  cases = [(bidirectional, qf.hf_mask(T, "bidirectional")),
           (bidirectional.replace(causal=True), qf.hf_mask(T, "causal")),
           (bidirectional.replace(attention_block_size=8), qf.hf_mask(T, "block", 8))]
  results = []
  for ours_config, mask in cases:
    ref = qf.reference_logits(reference, TOKENS, mask)
    _assert_close(_ours(params, ours_config), ref)
    results.append(ref)
  assert np.abs(results[0] - results[1]).max() > 1e-2 and np.abs(results[0] - results[2]).max() > 1e-2


def test_block_size_and_mask_overrides(converted, tmp_path):
  _, _, reference, directory = converted["mdlm"]
  config = convert(directory, str(tmp_path / "b8"), dtype="float32", block_size=8, mask_token_id=7)
  assert config.attention_block_size == 8 and config.mask_token_id == 7
  _, params = checkpoint.load(str(tmp_path / "b8"), dtype=jnp.float32)
  _assert_close(_ours(params, config), qf.reference_logits(reference, TOKENS, qf.hf_mask(T, "block", 8)))
  bd3lm_dir = converted["bd3lm"][3]
  assert convert(bd3lm_dir, str(tmp_path / "b0"), block_size=0).attention_block_size is None


def test_sdar_defaults_without_its_fields(converted, tmp_path):
  """An SDAR config.json without block_size / mask_token_id: block 4, mask from added_tokens.json `<MASK>`."""
  _, _, _, directory = converted["sdar"]
  hf = json.loads(open(f"{directory}/config.json").read())
  del hf["block_size"], hf["mask_token_id"]
  copy = tmp_path / "SDAR-copy"
  copy.mkdir()
  (copy / "config.json").write_text(json.dumps(hf))
  (copy / "model.safetensors").write_bytes(open(f"{directory}/model.safetensors", "rb").read())
  (copy / "added_tokens.json").write_text(json.dumps({"<MASK>": 93}))
  config = convert(str(copy), str(tmp_path / "out"))
  assert config.attention_block_size == 4 and config.mask_token_id == 93
  (copy / "added_tokens.json").unlink()
  with pytest.raises(ConfigError, match=r"no mask token id .* outside the vocabulary of 96\); pass mask_token_id"):
    convert(str(copy), str(tmp_path / "out2"))


@pytest.mark.parametrize("kwargs, message", [
    (dict(block_size=4), r"apply to the diffusion variants .* qwen3 is the causal language model"),
    (dict(mask_token_id=500), r"apply to the diffusion variants"),
])
def test_plain_qwen3_refuses_diffusion_overrides(converted, tmp_path, kwargs, message):
  with pytest.raises(ConfigError, match=message):
    convert(converted["qwen3"][3], str(tmp_path / "out"), **kwargs)
  assert not (tmp_path / "out").exists()


def test_bad_overrides_name_the_value(converted, tmp_path):
  with pytest.raises(ConfigError, match=r"mask_token_id is 500; expected a token id in \[0, 96\)"):
    convert(converted["mdlm"][3], str(tmp_path / "a"), mask_token_id=500)
  with pytest.raises(ConfigError, match=r"block_size must be 0 \(bidirectional\) or a positive block length, got -1"):
    convert(converted["mdlm"][3], str(tmp_path / "b"), block_size=-1)


def test_qwen3_chat_template_from_chat_template_jinja(tmp_path):
  """Qwen3's template (recognised by its enable_thinking switch, in chat_template.jinja as the A2D and SDAR
  repos ship it): ChatML, no default system turn, thinking off (an empty think block)."""
  from experiments.common import chat  # pylint: disable=import-outside-toplevel
  (tmp_path / "chat_template.jinja").write_text(
      "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
      "{%- endif %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- if enable_thinking is defined "
      "and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")
  form = chat.chat_format(str(tmp_path), "llada")
  assert (form.template, form.end_of_turn) == ("qwen3", "<|im_end|>")
  assert form.text("Hi?", None) == "<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_a2d_qwen2_is_a_bidirectional_qwen2(tmp_path):
  """dllm's A2D Qwen2.5-Coder layout: Qwen2 names with q/k/v biases, no q/k norm, bidirectional, unshifted;
  the mask id from added_tokens.json."""
  spec = qf.hf_fixtures.Spec("qwen2", kv_heads=2)
  reference = qf.hf_fixtures.build(spec, str(tmp_path / "Qwen2.5-Coder-tiny-diffusion-mdlm-v0.1"))
  directory = tmp_path / "Qwen2.5-Coder-tiny-diffusion-mdlm-v0.1"
  hf = json.loads((directory / "config.json").read_text())
  hf.update(model_type="a2d-qwen2", architectures=["A2DQwen2LMHeadModel"])
  (directory / "config.json").write_text(json.dumps(hf))
  (directory / "added_tokens.json").write_text(json.dumps({"<|mask|>": spec.vocab - 1}))
  config = convert(str(directory), str(tmp_path / "out"), dtype="float32")
  assert (config.causal, config.logit_shift, config.attention_block_size) == (False, 0, None)
  assert config.qkv_bias and not config.qk_norm and config.mask_token_id == spec.vocab - 1
  _, params = checkpoint.load(str(tmp_path / "out"), dtype=jnp.float32)
  tokens = TOKENS[:, :20] % spec.vocab
  with jax.default_matmul_precision("highest"):
    ours = np.asarray(forward(params, jnp.asarray(tokens), config=config).logits)
  _assert_close(ours, qf.reference_logits(reference, tokens, qf.hf_mask(20, "bidirectional")))


def _cli(*args):
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  return subprocess.run([sys.executable, "-m", "converters.convert", *args], cwd=root, capture_output=True, text=True,
                        timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))


def test_cli_flags(converted, tmp_path):
  """--block_size / --mask_token_id reach the converter; a bad value is a one-line error, exit 1, no output."""
  directory = converted["mdlm"][3]
  result = _cli(f"--hf_dir={directory}", f"--out_dir={tmp_path / 'ok'}", "--block_size=8", "--mask_token_id=7")
  assert result.returncode == 0, result.stderr[-2000:]
  written = json.loads((tmp_path / "ok" / "config.json").read_text())
  assert (written["attention_block_size"], written["mask_token_id"]) == (8, 7)
  result = _cli(f"--hf_dir={directory}", f"--out_dir={tmp_path / 'bad'}", "--block_size=-1")
  assert result.returncode == 1 and not (tmp_path / "bad").exists()
  errors = [line for line in result.stderr.splitlines() if "error" in line]
  assert errors == ["converters.convert: error: block_size must be 0 (bidirectional) or a positive block length, "
                    "got -1."]
  assert "Traceback" not in result.stderr


def test_overrides_are_refused_for_other_families(converted, tmp_path):
  with pytest.raises(ConfigError, match=r"apply to the Qwen3-layout diffusion variants .*not to qwen2"):
    convert(converted["qwen3"][3], str(tmp_path / "out"), arch="qwen2", block_size=4)


def test_stand_in_tokenizer_of_the_full_size_run():
  """benchmarks.random_checkpoint's tokenizer: one entry per embedding row, Qwen3's special ids, real words."""
  from benchmarks.stand_in_tokenizer import stand_in_tokenizer  # pylint: disable=import-outside-toplevel
  from dlm_jax.config import preset  # pylint: disable=import-outside-toplevel
  tokenizer = stand_in_tokenizer(preset("qwen3-0.6b-a2d-mdlm"))
  assert tokenizer.get_vocab_size() == 151936
  assert [tokenizer.token_to_id(t) for t in ("<|endoftext|>", "<|im_end|>", "<|mask|>")] == [151643, 151645, 151669]
  ids = tokenizer.encode("What is the capital of France?").ids
  assert len(ids) == 7 and tokenizer.token_to_id("<unk>") not in ids
  assert tokenizer.decode([151000], skip_special_tokens=False) == "<w151000>"
