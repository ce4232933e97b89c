"""experiments.generate as a user meets it, on the embedded models: the reply on stdout, the training layout by
default, EOS ends every reply, training-width refusals, one-line flag errors, readable help; and the shared
Ctrl-C and flag-error lines of `experiments.common.cli` (in process)."""

import json
import os
import subprocess
import sys

import pytest
from absl import flags

from experiments.common import cli, run_dir

try:
  from tests import experiments_fixtures as fx
except ImportError:
  import experiments_fixtures as fx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUESTION = "Anna has 16 books. She finds 4 more. She buys 2 more. How many books does Anna have?"

_DRIVER = r"""
import contextlib, importlib, io, json, sys
from absl import flags
module = importlib.import_module("experiments.generate")
from experiments.common import checkpoints, cli
cases, results = json.loads(sys.argv[1]), []
for args in cases:
  flags.FLAGS.unparse_flags()
  out, err, code = io.StringIO(), io.StringIO(), 0
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    try:
      cli.call(module.main, cli.parse_flags(["experiments.generate"] + args))
    except SystemExit as e:
      code = e.code
  results.append([code, out.getvalue(), err.getvalue()])
help_text = {name: flags.FLAGS[name].help for name in ("checkpoint", "sampler")}
print(json.dumps({"cases": results, "doc": module.__doc__, "help": help_text, "names": list(checkpoints.NAMES)}))
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """Every case below in one subprocess (one import, one JAX start-up)."""
  out = tmp_path_factory.mktemp("generate")
  long_prompt = " ".join(["Anna has 16 books."] * 40)
  layouts = fx.layout_checkpoints(str(out))
  small = ["--gen_length=8", "--steps=8", "--block_length=8"]
  cases = {
      "dlm": ["--checkpoint=tiny-dlm", f"--prompt={QUESTION}"],
      "arm": ["--checkpoint=tiny-arm", f"--prompt={QUESTION}", f"--json_out={out / 'arm.json'}"],
      "arm_on": ["--checkpoint=tiny-arm", f"--prompt={QUESTION}", "--nostop_at_eos", f"--json_out={out / 'on.json'}"],
      "long": ["--checkpoint=tiny-dlm", f"--prompt={long_prompt}"],
      "ids_too_long": ["--checkpoint=tiny-dlm", "--prompt_ids=" + ",".join(["7"] * 40), "--gen_length=32"],
      "ids_plus_gen": ["--checkpoint=tiny-dlm", "--prompt_ids=" + ",".join(["7"] * 30), "--gen_length=64"],
      "no_checkpoint": [f"--prompt={QUESTION}"],
      "bad_value": ["--checkpoint=tiny-dlm", f"--prompt={QUESTION}", "--steps=many"],
      "chat_and_training": ["--checkpoint=tiny-dlm", f"--prompt={QUESTION}", "--chat", "--prompt_format=training"],
      "dream_on_dlm": ["--checkpoint=tiny-dlm", "--sampler=dream", "--prompt=hi"],
      "block_diffusion_on_dlm": ["--checkpoint=tiny-dlm", "--sampler=block_diffusion", "--prompt=hi"],
      "empty": ["--checkpoint=tiny-dlm", "--prompt=", f"--json_out={out / 'empty.json'}"],
      "blank": ["--checkpoint=tiny-arm", "--prompt= \t "],
      "chat_default": [f"--checkpoint={layouts['chat']}", f"--prompt={QUESTION}", *small,
                       f"--json_out={out / 'chat.json'}"],
      "plain_default": [f"--checkpoint={layouts['plain']}", f"--prompt={QUESTION}", *small,
                        f"--json_out={out / 'plain.json'}"],
  }
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  done = subprocess.run([sys.executable, "-c", _DRIVER, json.dumps(list(cases.values()))], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=600, check=False)
  assert done.returncode == 0, done.stderr[-4000:]
  report = json.loads(done.stdout.strip().splitlines()[-1])
  return dict(zip(cases, report["cases"])), report, out


def _ok(case):
  code, stdout, stderr = case
  assert code == 0, stderr[-3000:]
  return stdout.splitlines()


def _one_line_error(case) -> str:
  code, _, stderr = case
  lines = [l for l in stderr.splitlines() if ": error: " in l]  # "<program>: error: <message>"
  assert code == 1 and len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
  return lines[0].split(": error: ", 1)[1]


def test_embedded_models_answer_in_their_training_layout(runs):
  cases, _, _ = runs
  for name in ("dlm", "arm"):  # 16 + 4 = 20, 20 + 2 = 22 (the synthetic task's answer format)
    text, summary = _ok(cases[name])[:2]
    assert text.endswith("#### 22"), (name, text)
    assert "NFE" in summary and " s" in summary and "training prompt of" in summary


def test_reply_ends_at_eos_unless_told_not_to(runs):
  from dlm_jax import default_models
  from dlm_jax.io import checkpoint  # pylint: disable=import-outside-toplevel
  from dlm_jax.io.tokenizer import Tokenizer  # pylint: disable=import-outside-toplevel
  cases, _, out = runs
  directory = default_models.path("tiny-arm")
  config = checkpoint.read_config(directory)
  tokenizer = Tokenizer.from_dir(directory, config)
  stopped = json.loads((out / "arm.json").read_text())
  reply = stopped["tokens"][stopped["prompt_length"]:]
  eos = reply.index(config.eos_token_id)
  assert eos < len(reply) - 1 and all(t == config.pad_token_id for t in reply[eos + 1:])
  assert stopped["text"] == tokenizer.decode(reply[:eos]) == _ok(cases["arm"])[0]
  going_on = json.loads((out / "on.json").read_text())
  rest = going_on["tokens"][going_on["prompt_length"]:]
  assert rest[:eos + 1] == reply[:eos + 1] and going_on["settings"]["stop_at_eos"] is False
  assert going_on["text"] == tokenizer.decode(rest, skip_special_tokens=True)
  assert not os.path.exists(os.path.join(ROOT, "out.json"))


def test_prompts_beyond_the_training_width_are_refused(runs):
  cases, _, _ = runs
  assert "trained with prompts of at most 36" in _one_line_error(cases["long"])
  assert "trained with prompts of at most 36" in _one_line_error(cases["ids_too_long"])
  line = _one_line_error(cases["ids_plus_gen"])
  assert "trained on sequences of 68" in line and "--gen_length of at most 38" in line


def test_flag_errors_are_one_line(runs):
  cases, _, _ = runs
  assert _one_line_error(cases["no_checkpoint"]) == "--checkpoint is required (see --helpfull)"
  assert "--steps=many" in _one_line_error(cases["bad_value"])
  assert "--chat is --prompt_format=chat" in _one_line_error(cases["chat_and_training"])


def test_a_sampler_that_does_not_fit_the_model_is_one_line(runs):
  cases, _, _ = runs
  assert _one_line_error(cases["dream_on_dlm"]) == ("tiny-dlm: sampler dream does not fit a bidirectional model "
                                                     "with logit_shift=0; use llada (or auto)")
  line = _one_line_error(cases["block_diffusion_on_dlm"])
  assert "sampler block_diffusion does not fit a bidirectional model" in line


def test_an_empty_prompt_is_a_usage_error(runs):
  cases, _, out = runs
  assert _one_line_error(cases["empty"]).startswith("--prompt='' is empty")
  assert _one_line_error(cases["blank"]).startswith("--prompt=' \\t ' is empty")
  assert not (out / "empty.json").exists()


def test_the_default_layout_is_the_checkpoints(runs):
  """auto: training for the embedded models (the summary line), chat for a checkpoint that records a chat
  template, plain (BOS + text) for one that records neither (`dlm_jax.io.prompt_layout`), said in the JSON."""
  from dlm_jax.io import checkpoint  # pylint: disable=import-outside-toplevel
  from dlm_jax.io.tokenizer import Tokenizer  # pylint: disable=import-outside-toplevel
  cases, _, out = runs
  directory = fx.layout_checkpoints(str(out))["plain"]
  config = checkpoint.read_config(directory)
  tokenizer = Tokenizer.from_dir(directory, config)
  for name in ("chat", "plain"):
    _ok(cases[f"{name}_default"])
    assert json.loads((out / f"{name}.json").read_text())["prompt_format"] == name
  plain = json.loads((out / "plain.json").read_text())
  assert plain["tokens"][:plain["prompt_length"]] == [config.bos_token_id] + tokenizer.encode(QUESTION)
  chat = json.loads((out / "chat.json").read_text())
  question, prompt = tokenizer.encode(QUESTION)[:-1], chat["tokens"][:chat["prompt_length"]]  # "?<|eot_id|>": 1 token
  inside = [i for i in range(len(prompt)) if prompt[i:i + len(question)] == question]
  assert len(inside) == 1 and 0 < inside[0] and inside[0] + len(question) < len(prompt)  # turn markers around it


def test_help_reads_well(runs):
  _, report, _ = runs
  assert max(len(line) for line in report["doc"].splitlines()) <= 120
  for name in report["names"]:  # every name --checkpoint takes
    assert name in report["help"]["checkpoint"]
  for name in ("tiny-dlm", "tiny-arm", "tiny-moe-dlm", "tiny-uniform-dlm", "smollm2"):
    assert name in report["doc"] and name in report["names"]
  assert "diffusion_gemma" in report["help"]["sampler"] and "diffusion_gemma" in report["doc"]


def test_flag_error_wording():
  two = flags.IllegalFlagValueError("flag --checkpoint=None: Flag --checkpoint must have a value other than None.\n"
                                    "flag --json_out=None: Flag --json_out must have a value other than None.")
  assert cli.flag_error_message(two) == "--checkpoint and --json_out are required"
  other = flags.UnrecognizedFlagError("bogus")
  assert cli.flag_error_message(other) == " ".join(str(other).split())


def test_ctrl_c_is_one_line_with_how_to_resume(tmp_path, capsys):
  def interrupted_main(argv):
    del argv
    raise KeyboardInterrupt

  cli.set_resume_hint(cli.DEFAULT_RESUME_HINT)
  with pytest.raises(SystemExit) as stop:
    cli.call(interrupted_main, ["prog"])
  assert stop.value.code == cli.INTERRUPTED_EXIT_CODE
  lines = capsys.readouterr().err.splitlines()
  assert len(lines) == 1 and lines[0].endswith("interrupted; nothing was written; run the same command again")
  run_dir.RunDir(str(tmp_path / "run"), {"a": 1})  # a run directory: the hint names it
  with pytest.raises(SystemExit):
    cli.call(interrupted_main, ["prog"])
  line = capsys.readouterr().err.strip()
  assert str(tmp_path / "run") in line and line.endswith("run the same command again to resume")
  cli.set_resume_hint(cli.DEFAULT_RESUME_HINT)
