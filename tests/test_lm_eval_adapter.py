"""The lm-eval model `dlm_jax` (experiments/lm_eval): model_args errors name the argument, presets resolve per
task, generate_until gives experiments.generate's text in lm-eval's order, loglikelihood is the library's
estimate, and lm-eval's real evaluator runs the local synthetic tasks offline on tiny-dlm and tiny-arm."""

import json

import jax
import numpy as np
import pytest
from absl import flags
from lm_eval import simple_evaluate
from lm_eval.api.instance import Instance
from lm_eval.tasks import TaskManager

from dlm_jax.analysis import likelihood_batch
from experiments.common import cli
from experiments.lm_eval import __main__ as entry
from experiments.lm_eval import args as args_lib
from experiments.lm_eval import scoring as scoring_lib
from experiments.lm_eval.model import DlmJaxLM

try:
  from tests import experiments_fixtures as fx
  from tests.experiments_fixtures import run_cases
except ImportError:  # pytest's rootdir-less import mode
  import experiments_fixtures as fx
  from experiments_fixtures import run_cases

DLM_ARGS = dict(checkpoint="tiny-dlm", gen_length=32, steps=32, block_length=8, batch_size=4, mc_num=8, mc_batch=4,
                pairs_per_call=32)
QUESTIONS = ["Anna has 16 books. She finds 4 more. She buys 2 more. How many books does Anna have?",
             "Tom has 3 pens. He loses 1. How many pens does Tom have?",
             "Mia has 20 coins. She buys 2 bags of 5 coins. She sells 4. How many coins does Mia have?"]


@pytest.fixture(scope="module")
def dlm():
  return DlmJaxLM(**DLM_ARGS)


@pytest.fixture(scope="module")
def arm():
  return DlmJaxLM(checkpoint="tiny-arm", batch_size=4)


def _request(kind, arguments, task="t"):
  return Instance(request_type=kind, doc={}, arguments=arguments, idx=0, metadata=(task, 0, 1))


@pytest.mark.parametrize("kwargs,name", [
    (dict(steps=0), "steps"), (dict(sampler="nope"), "sampler"), (dict(decoding="fast"), "decoding"),
    (dict(cfg=-1), "cfg"), (dict(mask_sinks="two"), "mask_sinks"), (dict(mc_num=0), "mc_num"),
    (dict(estimator="x"), "estimator"), (dict(dtype="int8"), "dtype"), (dict(preset="paper"), "preset"),
    (dict(top_p=2.0), "top_p"), (dict(is_check_greedy="maybe"), "is_check_greedy"), (dict(colour=1), "colour"),
    (dict(sink_token="back"), "sink_token"), (dict(threshold=2.0, decoding="threshold"), "decoding"),
    (dict(temperature="nan"), "temperature"), (dict(cfg="inf"), "cfg"), (dict(prompt_format="chat"), "prompt_format"),
    (dict(policy="sparse_dllm:keep_ratio=2"), "policy"), (dict(policy="fastest"), "policy"),
])
def test_bad_model_args_name_the_argument(kwargs, name):
  with pytest.raises(cli.UserError, match=rf"^model_args {name}\b"):
    args_lib.parse(dict(checkpoint="tiny-dlm", **kwargs))


def test_cli_reports_a_bad_value_in_one_line(capsys):
  flags.FLAGS.unparse_flags()
  with pytest.raises(SystemExit) as exit_info:
    entry.main(["lm_eval", "--model", "dlm_jax", "--model_args", "checkpoint=tiny-dlm,mc_batch=0", "--tasks",
                "dlm_synthetic_mc"])
  err = capsys.readouterr().err.strip().splitlines()
  assert exit_info.value.code == 1
  assert err[-1].endswith("error: model_args mc_batch=0: expected a positive integer"), err[-3:]
  assert not any("Traceback" in line for line in err)


def test_presets_resolve_per_task_and_given_values_win():
  args = args_lib.parse(dict(checkpoint="tiny-dlm", preset="llada_official"))
  assert (args.for_task("mmlu_anatomy").mc_num, args.for_task("mmlu_anatomy").mc_batch) == (1, 1)
  assert (args.for_task("arc_challenge").cfg, args.for_task("arc_challenge").mc_num) == (0.5, 128)
  assert args.for_task("truthfulqa_mc2").cfg == 2.0
  gsm = args.for_task("gsm8k")
  assert (gsm.gen_length, gsm.steps, gsm.block_length) == (1024, 1024, 1024)
  assert args_lib.parse(dict(checkpoint="tiny-dlm", preset="dllm")).for_task("hellaswag").mc_num == 32
  assert args_lib.parse(dict(checkpoint="tiny-dlm", preset="dllm", cfg=0.0)).for_task("hellaswag").cfg == 0.0
  assert args_lib.parse(dict(checkpoint="tiny-dlm", preset="llada_official_256")).for_task("bbh_cot").steps == 256


def _generate_reference(tmp_path, prompts):
  """experiments.generate's JSON for each prompt's ids (one subprocess: its own flags and JAX start-up)."""
  outs = [tmp_path / f"out_{i}.json" for i in range(len(prompts))]
  cases = [["--checkpoint=tiny-dlm", "--sampler=llada", f"--prompt_ids={','.join(map(str, ids))}", "--gen_length=32",
            "--steps=32", "--block_length=8", f"--json_out={out}"] for ids, out in zip(prompts, outs)]
  for code, stderr in run_cases("generate", cases):
    assert code == 0, stderr
  return [json.loads(out.read_text()) for out in outs]


def test_generate_until_matches_experiments_generate_in_request_order(dlm, tmp_path):
  until = [["\n"], ["####"], ["="]]
  requests = [_request("generate_until", (q, {"until": u, "max_gen_toks": 32})) for q, u in zip(QUESTIONS, until)]
  texts = dlm.generate_until(requests)
  tokenizer = dlm.model.tokenizer
  results = _generate_reference(tmp_path, [dlm.context_ids(question) for question in QUESTIONS])
  for stops, text, result in zip(until, texts, results):
    generated = result["tokens"][result["prompt_length"]:]
    eos = dlm.model.config.eos_token_id
    expected = tokenizer.decode(generated[:generated.index(eos)] if eos in generated else generated)
    for stop in stops:
      expected = expected.split(stop)[0]
    assert text == expected


def test_loglikelihood_is_the_library_estimate(dlm, arm):
  contexts = [(QUESTIONS[0], " 16 + 4 = 20 . #### 20"), (QUESTIONS[1], " 3 - 1 = 2 . #### 2")]
  requests = [_request("loglikelihood", pair) for pair in contexts]
  got = dlm.loglikelihood(requests)
  pairs = [dlm.encode_pair(*pair) for pair in contexts]
  settings = likelihood_batch.MCSettings("llada", mc_num=8, group=4)
  expected = likelihood_batch.mc_log_likelihoods(dlm.model.params, pairs, config=dlm.model.config,
                                                 settings=settings, seed=0, batch_size=32)
  np.testing.assert_allclose([g[0] for g in got], expected, rtol=1e-6)
  assert not any(g[1] for g in got)
  exact = arm.loglikelihood(requests)
  scores, greedy = likelihood_batch.ar_log_likelihoods(arm.model.params, [arm.encode_pair(*p) for p in contexts],
                                                       config=arm.model.config, batch_size=4)
  np.testing.assert_allclose([e[0] for e in exact], scores, rtol=1e-6)
  assert [e[1] for e in exact] == list(greedy)
  rolling = arm.loglikelihood_rolling([_request("loglikelihood_rolling", (" 3 - 1 = 2 .",))])
  bos, ids = arm.model.config.bos_token_id, arm.model.tokenizer.encode(" 3 - 1 = 2 .")
  whole, _ = likelihood_batch.ar_log_likelihoods(arm.model.params, [([bos], ids)], config=arm.model.config,
                                                 batch_size=4)
  np.testing.assert_allclose(rolling, whole, rtol=1e-6)


def test_lm_eval_evaluator_runs_the_local_tasks_offline(dlm, arm):
  manager = TaskManager(include_path=entry.TASKS_DIR, include_defaults=False)
  for lm in (dlm, arm):
    out = simple_evaluate(model=lm, tasks=["dlm_synthetic_gen", "dlm_synthetic_mc"], limit=4, task_manager=manager,
                          log_samples=True, bootstrap_iters=0)
    gen, mc = out["results"]["dlm_synthetic_gen"], out["results"]["dlm_synthetic_mc"]
    assert out["config"]["prompt_format"] == "training"  # the layout used, recorded in the results
    assert 0 <= gen["exact_match,strict-match"] <= 1 and 0 <= mc["acc,none"] <= 1
    assert len(out["samples"]["dlm_synthetic_mc"]) == 4
    assert all(np.isfinite(r[0][0]) for s in out["samples"]["dlm_synthetic_mc"] for r in s["resps"])
    if lm is arm:  # the trained ARM solves these four problems; a broken prompt, cut or score would not
      assert gen["exact_match,strict-match"] == 1.0 and mc["acc,none"] == 1.0
    else:  # the DLM in its training layout (the default) picks every right answer (measured: gen 0.5)
      assert mc["acc,none"] == 1.0
  jax.clear_caches()


def test_the_default_prompt_layout_is_the_checkpoints(dlm, arm, tmp_path):
  """prompt_format=auto (the default) takes `dlm_jax.io.prompt_layout`'s rule: the training layout for the
  embedded models ([PAD … BOS question] of width 36 for the DLM), plain for a checkpoint without a training
  record (its chat default is lm-eval's --apply_chat_template)."""
  from experiments.common import checkpoints  # pylint: disable=import-outside-toplevel
  from experiments.lm_eval.model import resolve_prompt_format  # pylint: disable=import-outside-toplevel
  assert dlm.args.prompt_format == "auto" and (dlm.prompt_format, arm.prompt_format) == ("training", "training")
  assert dlm.get_model_info()["prompt_format"] == "training"
  config, tokenizer = dlm.model.config, dlm.model.tokenizer
  row = [config.bos_token_id] + tokenizer.encode(QUESTIONS[1])
  ids = dlm.context_ids(QUESTIONS[1])
  assert len(ids) == 36 and ids[-len(row):] == row and set(ids[:-len(row)]) == {config.pad_token_id}
  layouts = fx.layout_checkpoints(str(tmp_path))
  for name in ("chat", "plain"):
    model = checkpoints.prepare(layouts[name], "auto", "auto")
    assert resolve_prompt_format("auto", model) == "plain"
    with pytest.raises(cli.UserError, match="^model_args prompt_format=training: .* no training.json"):
      resolve_prompt_format("training", model)


def test_table1_helpers():
  from experiments.lm_eval import table1  # pylint: disable=import-outside-toplevel
  assert table1.extra_args("gen_length=32+steps=8") == {"gen_length": "32", "steps": "8"}
  with pytest.raises(cli.UserError, match="--model_args=steps"):
    table1.extra_args("steps")
  results = {"alias": "x", "sample_len": 16, "exact_match,strict-match": 0.5, "exact_match_stderr,strict-match": 0.1}
  assert table1.first_metric(results) == ("exact_match,strict-match", 0.5, 16)


def _llada_greedy(lm, context, length):
  """LLaDA's suffix greedy prediction written out: `length` masks after the context; each step unmasks the
  masked position whose argmax has the highest probability, with that argmax."""
  from dlm_jax import model as model_lib  # pylint: disable=import-outside-toplevel
  config = lm.model.config
  seq = np.asarray(context + [config.mask_token_id] * length)
  for _ in range(length):
    logits = np.asarray(model_lib.forward(lm.model.params, seq[None], config=config).logits[0], np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    confidence = np.where(seq == config.mask_token_id, probs.max(-1), -np.inf)
    position = int(np.argmax(confidence))
    seq[position] = int(np.argmax(probs[position]))
  return seq[len(context):].tolist()


def test_is_check_greedy_compares_with_the_greedy_suffix():
  lm = DlmJaxLM(**{**DLM_ARGS, "is_check_greedy": True, "prompt_format": "training"})
  question = QUESTIONS[1]
  context = lm.encode_pair(question, " 3 - 1 = 2 .")[0]
  greedy = _llada_greedy(lm, context, 3)
  text = lm.model.tokenizer.decode(greedy)
  wrong = greedy[:2] + [next(t for t in (10, 11) if t != greedy[2])]
  pairs = [(context, greedy), (context, wrong)]
  flags_got = [flag for _, flag in scoring_lib.score_pairs(lm, pairs, [None, None])]
  assert flags_got == [True, False], (text, greedy)


def test_generate_until_honours_each_requests_max_gen_toks(arm):
  """Without gen_length in model_args a request's max_gen_toks is its length; greedy AR text is prefix-stable."""
  requests = [_request("generate_until", (QUESTIONS[0], {"until": [], "max_gen_toks": 4})),
              _request("generate_until", (QUESTIONS[0], {"until": [], "max_gen_toks": 32}))]
  short, full = arm.generate_until(requests)
  assert len(full.split()) > 4 and short.split() == full.split()[:4]


def test_a_steering_file_steers_generation_and_a_zero_coefficient_changes_nothing(dlm, tmp_path):
  requests = [_request("generate_until", (q, {"until": ["\n"], "max_gen_toks": 32})) for q in QUESTIONS[:2]]
  plain = dlm.generate_until(requests)
  d = dlm.model.config.d_model
  np.save(tmp_path / "direction.npy", np.ones((d,), np.float32))
  texts = {}
  for coefficient in (0.0, 8.0):
    spec = tmp_path / f"steer_{coefficient}.json"
    spec.write_text(json.dumps({"blocks.1.hook_resid_post": {"vector": "direction.npy", "coefficient": coefficient,
                                                             "positions": "masked", "steps": [0, 16]}}))
    steered = DlmJaxLM(**DLM_ARGS, steer=str(spec))
    texts[coefficient] = steered.generate_until(requests)
  assert texts[0.0] == plain
  assert texts[8.0] != plain
  bad = tmp_path / "bad.json"
  bad.write_text(json.dumps({"blocks.1.hook_nope": {"vector": [1.0]}}))
  with pytest.raises(cli.UserError, match=r"^model_args steer=.*unknown site 'blocks.1.hook_nope'") as error:
    args_lib.parse(dict(checkpoint="tiny-dlm", steer=str(bad)))
  assert "\n" not in str(error.value)
  wrong = tmp_path / "wrong.json"
  wrong.write_text(json.dumps({"blocks.1.hook_resid_post": {"vector": [1.0, 2.0]}}))
  with pytest.raises(cli.UserError, match=r"vector must be \[128\] finite numbers"):
    DlmJaxLM(**DLM_ARGS, steer=str(wrong)).generate_until(requests[:1])
