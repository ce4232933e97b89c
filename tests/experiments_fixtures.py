"""Tiny checkpoints for the experiment-binary tests: random weights in the layout of the embedded default
models (synthetic-task tokenizer, training.json with the SFT / AR prompt layout), and runners for
`python -m experiments.<binary>` in a subprocess, or for several binaries' cases in one subprocess."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import jax

from dlm_jax import model
from dlm_jax.training import loop as train_loop
from dlm_jax.config import preset
from dlm_jax.tasks import synthetic
from tests.light_configs import DIFFUSIONGEMMA_SG

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEQ_LEN, PROMPT_LEN = 68, 36


def tiny_checkpoint(directory: str, kind: str, seed: int = 0, sink: str = "none") -> str:
  """A random tiny checkpoint with the synthetic tokenizer: kind "dlm" (LLaDA-style), "dream" (shifted
  DLM), "arm" (causal), "llada2" (block-causal mixture of experts, blocks of 4) or "uniform"
  (DiffusionGemma-style: sliding and global layers, MoE, self-conditioning; `light_configs.DIFFUSIONGEMMA_SG`).
  Returns the directory."""
  tokenizer = synthetic.build_tokenizer()
  ids = dict(vocab_size=tokenizer.get_vocab_size(), pad_token_id=tokenizer.token_to_id("[PAD]"),
             bos_token_id=tokenizer.token_to_id("[BOS]"), eos_token_id=tokenizer.token_to_id("[EOS]"))
  base = {"dlm": preset("tiny-llada"), "dream": preset("tiny-dream"), "arm": preset("tiny-llama"),
          "llada2": preset("tiny-llada2"), "uniform": DIFFUSIONGEMMA_SG}[kind]
  mask_id = None if kind in ("arm", "uniform") else tokenizer.token_to_id("[MASK]")
  config = base.replace(name=f"test-{kind}", eot_token_id=None, mask_token_id=mask_id, **ids)
  params = jax.device_get(model.init_params(config, jax.random.key(seed)))
  objective = {"arm": "ar", "uniform": "uniform"}.get(kind, "sft")
  record = {"train_config": {"objective": objective, "sink": sink,
                             "sink_token_id": tokenizer.token_to_id("[SINK]") if sink != "none" else None},
            "data": {"data": "synthetic", "seq_len": SEQ_LEN - 4 if kind == "arm" else SEQ_LEN,
                     "prompt_len": PROMPT_LEN, "layout": "ar" if kind == "arm" else "sft"}}
  train_loop.save_converted(directory, config, params, tokenizer, training_record=record)
  return directory


LLAMA3_TEMPLATE = ("{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>' "
                   "+ message['content'] + '<|eot_id|>' }}{% endfor %}")


def layout_checkpoints(root: str) -> dict[str, str]:
  """tiny-dlm's weights and tokenizer (copied: a checkpoint's files must lie inside it) in three directories, one
  per default prompt layout of `dlm_jax.io.prompt_layout`: "training" (the embedded model itself: training.json
  records a prompt width), "chat" (no training.json, a chat template in tokenizer_config.json) and "plain" (neither)."""
  from dlm_jax import default_models  # pylint: disable=import-outside-toplevel
  source = default_models.path("tiny-dlm")
  directories = {"training": source}
  for name in ("chat", "plain"):
    directory = os.path.join(root, f"tiny-dlm-{name}")
    os.makedirs(directory, exist_ok=True)
    for file in ("config.json", "model.safetensors", "tokenizer.json"):
      if not os.path.exists(os.path.join(directory, file)):
        shutil.copyfile(os.path.join(source, file), os.path.join(directory, file))
    directories[name] = directory
  with open(os.path.join(directories["chat"], "tokenizer_config.json"), "w", encoding="utf-8") as f:
    json.dump({"chat_template": LLAMA3_TEMPLATE}, f)
  return directories


def run_module(module: str, *flags: str, timeout: int = 600) -> subprocess.CompletedProcess:
  """Runs `python -m <module> flags...` from the repository root on the CPU."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", module, *flags], cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=timeout)


def run_binary(name: str, *flags: str, timeout: int = 600, expect_ok: bool = True) -> subprocess.CompletedProcess:
  """Runs `python -m experiments.<name> flags...` from the repository root on the CPU."""
  result = run_module(f"experiments.{name}", *flags, timeout=timeout)
  if expect_ok:
    assert result.returncode == 0, f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-6000:]}"
  return result


def read_jsonl(path: str) -> list[dict]:
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


_CASES_DRIVER = r"""
import contextlib, importlib, io, json, sys
from absl import app, flags, logging
app.define_help_flags()  # as absl.app.run does
logging.use_absl_handler()
tests_dir, cases, show_info = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3] == "1"
sys.path.append(tests_dir)
import binary_isolation
results, loaded = [], None
for name, args in cases:
  if name != loaded:
    binary_isolation.forget_binaries()
    module = importlib.import_module(name)
    from experiments.common import cli
    loaded = name
  sys.argv[0] = name  # the program name of error lines, as under `python -m <name>`
  flags.FLAGS.unparse_flags()
  err, out, code = io.StringIO(), io.StringIO(), 0
  logging.get_absl_handler().python_handler.stream = err  # log lines are part of the case's stderr
  with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
    try:
      argv = cli.parse_flags([name] + args)
      if show_info and flags.FLAGS["verbosity"].using_default_value:  # as absl.app.run does
        flags.FLAGS.verbosity = 0
      cli.call(module.main, argv)
    except SystemExit as e:
      code = e.code
      if code is not None and not isinstance(code, int):  # sys.exit("message"), as the interpreter reports it
        print(code, file=sys.stderr)
        code = 1
  results.append([code, err.getvalue(), out.getvalue()])
print(json.dumps(results))
"""


def run_modules(cases: list[tuple[str, list[str]]], cwd: str = ROOT, timeout: int = 600,
                show_info: bool = False) -> list[tuple[int, str, str]]:
  """Runs each case's binary (a module name: `experiments.generate`, `converters.gguf`, ...) `main` with its flag
  list, one after another in one CPU subprocess started in `cwd` (one interpreter and JAX start-up; flags and
  binary modules are reset between binaries by `binary_isolation.forget_binaries`, so consecutive cases of one
  binary share its import and the process's compiled programs); returns (exit code, stderr, stdout) per case.
  Flag parsing, error reporting, the program name in error lines and `sys.exit("message")` are those of
  `experiments.common.cli.run` under `python -m`; absl's INFO log lines are in stderr only with `show_info`
  (`python -m` shows them: absl.app.run sets --verbosity=0), warnings always."""
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
  result = subprocess.run([sys.executable, "-c", _CASES_DRIVER, os.path.join(ROOT, "tests"),
                           json.dumps([[name, list(args)] for name, args in cases]), "1" if show_info else "0"],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
  assert result.returncode == 0, result.stderr[-6000:]
  return [tuple(x) for x in json.loads(result.stdout.strip().splitlines()[-1])]


def run_cases(name: str, cases: list[list[str]], timeout: int = 600) -> list[tuple[int, str]]:
  """Runs `experiments.<name>`'s main once per flag list, in one CPU subprocess (one import, one JAX
  start-up); returns (exit code, stderr) per case (`run_modules`)."""
  return [(code, err) for code, err, _ in run_modules([(f"experiments.{name}", args) for args in cases],
                                                       timeout=timeout)]
