"""The chat template a checkpoint records wins over the sampler's (SmolLM2's ChatML from its GGUF
metadata), its end-of-turn token ends a reply, a sampler without a template of its own needs one named, and
unknown tokens are counted and warned about."""

import json

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers

from dlm_jax.io.tokenizer import Tokenizer
from experiments.common import chat
from experiments.common.cli import UserError

SMOLLM2_TEMPLATE = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
                    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
                    "'<|im_end|>' + '\n'}}{% endfor %}")


def _checkpoint_dir(tmp_path, template):
  if template is not None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
  return str(tmp_path)


def test_recorded_chatml_template_wins_over_the_sampler(tmp_path):
  form = chat.chat_format(_checkpoint_dir(tmp_path, SMOLLM2_TEMPLATE), "ar")
  assert form.template == "chatml" and form.end_of_turn == "<|im_end|>"
  assert form.system == "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
  text = form.text("Hi?", bos="<|begin_of_text|>")
  assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
                  "<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\n")
  assert chat.chat_format(str(tmp_path), "ar", override="llama3").template == "llama3"


def test_without_a_chatml_template_the_sampler_decides(tmp_path):
  llama = "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>' }}"
  assert chat.chat_format(_checkpoint_dir(tmp_path, llama), "ar").template == "llama3"
  assert chat.chat_format(str(tmp_path), "llada").template == "llada"
  empty = tmp_path / "empty"
  empty.mkdir()
  form = chat.chat_format(str(empty), "dream")
  assert form.template == "dream" and form.end_of_turn == "<|im_end|>"
  assert chat.chat_format(str(empty), "mmada").end_of_turn == "<|eot_id|>"
  assert chat.chat_format(str(empty), "block_diffusion").template == "ling"


def test_a_sampler_without_a_template_is_refused_in_one_line(tmp_path):
  with pytest.raises(UserError, match="records no chat template and the diffusion_gemma sampler has none"):
    chat.chat_format(str(tmp_path), "diffusion_gemma")
  assert chat.chat_format(str(tmp_path), "diffusion_gemma", override="chatml").template == "chatml"


def test_unknown_tokens_are_counted():
  backend = Backend(models.WordLevel({"[UNK]": 0, "two": 1, "plus": 2}, unk_token="[UNK]"))
  backend.pre_tokenizer = pre_tokenizers.Whitespace()
  tokenizer = Tokenizer(backend)
  ids = tokenizer.encode("two plus three plus four")
  assert chat.warn_unknown_tokens(tokenizer, ids, "test") == 2
  assert chat.warn_unknown_tokens(tokenizer, tokenizer.encode("two plus two"), "test") == 0


def test_plain_prompts_need_no_chat_template():
  """A plain prompt is the question's ids after BOS: a sampler without a chat template of its own
  (DiffusionGemma's) still encodes plain prompts; only the chat format asks for a template."""
  from experiments.common import checkpoints, prompts  # pylint: disable=import-outside-toplevel
  from experiments.common.items import Item  # pylint: disable=import-outside-toplevel
  item = Item(id="0", question="What is 2 + 3?", target="#### 5", kind="gsm8k")
  model = checkpoints.prepare("tiny-uniform-dlm", "auto", "plain")
  encoded = prompts.encode(model, [item])
  bos = [] if model.config.bos_token_id is None else [model.config.bos_token_id]
  assert encoded.sequences["0"][:len(bos)] == bos and len(encoded.sequences["0"]) > len(bos)
  with pytest.raises(UserError, match="chat template"):
    prompts.encode(checkpoints.prepare("tiny-uniform-dlm", "auto", "chat"), [item])
