"""Tokenizer loading (tokenizer.json; vocab.json + merges.txt) and the four chat templates, with tiny real
`tokenizers` objects trained here."""

import json

import numpy as np
import pytest
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from dlm_jax.config import preset
from dlm_jax.io.tokenizer import QWEN2_SPLIT_PATTERN, Tokenizer as DlmTokenizer
from dlm_jax.io.tokenizer import chat_text, left_pad

SENTENCES = ["Hello world, how are you today?", "The quick brown fox jumps over the lazy dog.",
             "Masked diffusion models decode in parallel.", "What is 12 + 30? It is 42!", "héllo wörld ünïcode"]
SPECIALS = ["<|startoftext|>", "<|endoftext|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
            "<|mdm_mask|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>"]


def _byte_level(tokenizer: Tokenizer) -> Tokenizer:
  tokenizer.normalizer = normalizers.NFC()
  tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tokenizer.decoder = decoders.ByteLevel()
  return tokenizer


def _trained(special_tokens):
  tokenizer = _byte_level(Tokenizer(models.BPE()))
  trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=special_tokens,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
  tokenizer.train_from_iterator(SENTENCES * 5, trainer)
  return tokenizer


@pytest.fixture(scope="module")
def json_dir(tmp_path_factory):
  directory = tmp_path_factory.mktemp("json_tok")
  _trained(SPECIALS).save(str(directory / "tokenizer.json"))
  return directory


@pytest.fixture(scope="module")
def slow_dir(tmp_path_factory):
  """Dream-style files: vocab.json + merges.txt, specials appended as added tokens after the vocabulary."""
  directory = tmp_path_factory.mktemp("slow_tok")
  reference = _trained([])
  reference.model.save(str(directory))
  base = reference.get_vocab_size()
  added = {str(base + i): {"content": t, "special": True, "lstrip": False, "rstrip": False, "normalized": False,
                           "single_word": False} for i, t in enumerate(SPECIALS)}
  (directory / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": added}))
  reference.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
  return directory, reference


def test_tokenizer_json_round_trip_and_special_tokens(json_dir):
  tok = DlmTokenizer.from_dir(str(json_dir))
  ids = tok.encode("<|startoftext|>Hello world<|eot_id|>")
  assert ids[0] == tok.token_to_id("<|startoftext|>") and ids[-1] == tok.token_to_id("<|eot_id|>")
  assert tok.decode(ids) == "Hello world"
  assert tok.decode(ids, skip_special_tokens=False) == "<|startoftext|>Hello world<|eot_id|>"
  assert tok.decode(tok.encode("héllo wörld 42!")) == "héllo wörld 42!"


def test_vocab_and_merges_match_the_reference_tokenizer(slow_dir):
  directory, reference = slow_dir
  tok = DlmTokenizer.from_dir(str(directory))
  assert tok.vocab_size == reference.get_vocab_size()
  for text in SENTENCES + ["<|im_start|>user\nWhat is 7?<|im_end|>\n", "  spaces\n\nand lines  "]:
    assert tok.encode(text) == reference.encode(text, add_special_tokens=False).ids
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
  for token in SPECIALS:
    assert tok.token_to_id(token) == reference.token_to_id(token)


def test_added_token_gap_is_an_error(tmp_path, slow_dir):
  directory, reference = slow_dir
  for name in ("vocab.json", "merges.txt"):
    (tmp_path / name).write_bytes((directory / name).read_bytes())
  wrong = {"100000": {"content": "<|x|>", "special": True}}
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": wrong}))
  with pytest.raises(ValueError, match="next free id"):
    DlmTokenizer.from_dir(str(tmp_path))


def test_special_ids_come_from_the_config(json_dir, tmp_path):
  config = preset("tiny-llada")
  tok = DlmTokenizer.from_dir(str(json_dir), config)
  assert (tok.mask_token_id, tok.eos_token_id, tok.eot_token_id) == (255, 1, 2)
  for name in ("tokenizer.json",):
    (tmp_path / name).write_bytes((json_dir / name).read_bytes())
  (tmp_path / "config.json").write_text(config.to_json())
  assert DlmTokenizer.from_dir(str(tmp_path)).bos_token_id == config.bos_token_id
  assert DlmTokenizer.from_dir(str(json_dir)).bos_token_id is None


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  What is 2+2? \n"}]


def test_llada_template():
  assert chat_text(MESSAGES, "llada") == (
      "<|startoftext|><|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
      "<|start_header_id|>assistant<|end_header_id|>\n\n")
  history = MESSAGES + [{"role": "assistant", "content": "4"}]
  assert chat_text(history, "llada", add_generation_prompt=False).endswith(
      "<|start_header_id|>assistant<|end_header_id|>\n\n4<|eot_id|><|endoftext|>")


def test_mmada_template_has_one_newline():
  assert chat_text([{"role": "user", "content": "Hi"}], "mmada") == (
      "<|startoftext|><|start_header_id|>user<|end_header_id|>\nHi<|eot_id|>"
      "<|start_header_id|>assistant<|end_header_id|>\n")


def test_dream_template_chatml_with_default_system():
  assert chat_text([{"role": "user", "content": "Hi"}], "dream") == (
      "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
      "<|im_start|>assistant\n")
  assert chat_text(MESSAGES, "dream").startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")


def test_llama3_template():
  assert chat_text(MESSAGES, "llama3") == (
      "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
      "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
      "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_apply_chat_template_encodes_headers_as_single_ids(json_dir):
  tok = DlmTokenizer.from_dir(str(json_dir), preset("tiny-llada").replace(bos_token_id=None))
  ids = tok.apply_chat_template([{"role": "user", "content": "Hello world"}], "llada")
  header = [tok.token_to_id(t) for t in ("<|startoftext|>", "<|start_header_id|>")]
  assert ids[:2] == header
  assert ids.count(tok.token_to_id("<|start_header_id|>")) == 2
  assert tok.decode(ids) == "user\n\nHello worldassistant\n\n"
  with pytest.raises(ValueError, match="Unknown chat template"):
    chat_text(MESSAGES, "nope")


def test_left_pad():
  ids, mask = left_pad([[5, 6, 7], [8]], pad_id=1)
  np.testing.assert_array_equal(ids, [[5, 6, 7], [1, 1, 8]])
  np.testing.assert_array_equal(mask, [[1, 1, 1], [0, 0, 1]])


def test_ling_template():
  messages = [{"role": "system", "content": "detailed thinking off"}, {"role": "user", "content": "2+2?"}]
  assert chat_text(messages, "ling") == ("<role>SYSTEM</role>detailed thinking off<|role_end|>"
                                         "<role>HUMAN</role>2+2?<|role_end|><role>ASSISTANT</role>")
