"""One default prompt layout for every entry point (`dlm_jax.io.prompt_layout`): training when the checkpoint
records a training prompt width, else chat when it records a chat template, else plain — the same answer from
the rule itself, the analysis binaries' `checkpoints.prepare` and the library's `tasks.evaluation.complete`
(experiments.generate: tests/test_generate_usability.py; lm-eval: tests/test_lm_eval_adapter.py). No model
is loaded here."""

import pytest

from dlm_jax.io import prompt_layout
from dlm_jax.tasks import evaluation
from experiments.common import checkpoints, prompts
from experiments.common.items import Item

try:
  from tests import experiments_fixtures as fx
except ImportError:
  import experiments_fixtures as fx


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
  return fx.layout_checkpoints(str(tmp_path_factory.mktemp("layouts")))


def test_the_rule_reads_the_checkpoint(layouts):
  for expected, directory in layouts.items():
    assert prompt_layout.default_layout(directory) == expected, directory
    assert prompt_layout.resolve("auto", directory) == expected
    assert prompt_layout.resolve("plain", directory) == "plain"  # an explicit format wins


def test_the_analysis_binaries_take_the_same_default(layouts):
  item = Item("0", "Tom has 3 pens. He loses 1. How many pens does Tom have?", "#### 2", "gsm8k")
  for expected, directory in layouts.items():
    model = checkpoints.prepare(directory, "auto", "auto")
    assert model.prompt_format == expected, directory
  plain = prompts.encode(checkpoints.prepare(layouts["plain"], "auto", "auto"), [item]).sequences["0"]
  training = prompts.encode(checkpoints.prepare(layouts["training"], "auto", "auto"), [item]).sequences["0"]
  assert len(training) == 36 and training[-len(plain):] == plain  # [PAD … BOS question] ends in BOS question


def test_the_python_helper_refuses_a_checkpoint_trained_in_another_layout(layouts):
  for name in ("chat", "plain"):
    with pytest.raises(ValueError, match=f"default is {name}.*pass prompt_len"):
      evaluation.complete(layouts[name], ["Tom has 3 pens. He loses 1. How many pens does Tom have?"])
