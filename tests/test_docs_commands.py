"""Every `python -m experiments.* / converters.* / benchmarks.*` command in README.md, BUILD.md and the guides
(docs/guides/*.md) parses as written: its module exists, every flag exists and takes its value, no stray
arguments (shell variables of the same code block are expanded by bash). The quick ones on the embedded
models run as written (after the documented commands that write their inputs, `RUN_BEFORE`), each binary's
`main` with the documented flags in one process per test (`experiments_fixtures.run_modules`: the command line
itself is what `test_documented_commands_parse` checks)."""

import glob
import json
import os
import re
import subprocess
import sys

import pytest

try:
  from tests import experiments_fixtures as fx
except ImportError:
  import experiments_fixtures as fx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ("README.md", "BUILD.md") + tuple(sorted(os.path.relpath(path, ROOT)
                                                 for path in glob.glob(os.path.join(ROOT, "docs", "guides", "*.md"))))
COMMAND = re.compile(r"python -m ((?:experiments|converters|benchmarks)\.\w+)")
ASSIGNMENT = re.compile(r"^[A-Z_]+=")
RUN_AS_WRITTEN = ("experiments.generate", "experiments.forward")
RUN_BEFORE = {"experiments.generate": "experiments.corpus_prior"}  # writes the prior.json a documented generate reads
POSITIONAL = {"experiments.explore": 1}  # binaries that take positional arguments (`cli.run(main, arguments=N)`)
NOT_ABSL = {"experiments.lm_eval"}  # lm-eval's own command line (its model_args are tested in test_lm_eval_adapter)

_PARSE_DRIVER = r"""
import importlib, json, sys
from absl import flags
tests_dir, by_module, positional = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
sys.path.append(tests_dir)
import binary_isolation
problems = []
for module, commands in by_module.items():
  binary_isolation.forget_binaries()
  importlib.import_module(module)
  for argv in commands:
    flags.FLAGS.unparse_flags()
    try:
      rest = flags.FLAGS([module] + argv)
      if len(rest) > 1 + positional.get(module, 0):
        problems.append([module, argv, "stray arguments %s" % rest[1:]])
    except flags.Error as e:
      problems.append([module, argv, str(e)])
print(json.dumps(problems))
"""
"""Parses every documented command of every binary in one process: each binary imported afresh, its flags alone
defined (`tests/binary_isolation.py`), as in its own process."""


def _snippets(text: str) -> list[tuple[list[str], str]]:
  """(variable assignments, command text from `python -m` on) of every documented command."""
  found = []
  blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
  for block in blocks:
    assignments = []
    for line in block.replace("\\\n", " ").splitlines():
      line = line.strip()
      if ASSIGNMENT.match(line):
        assignments.append(line)
      match = COMMAND.search(line)
      if match:
        command = line[match.start():].split(" & done")[0]
        found.append((assignments, re.sub(r"\s+#.*$", "", command)))
  rest = re.sub(r"```.*?```", "", text, flags=re.S)
  for span in re.findall(r"`([^`\n]+)`", rest):
    match = COMMAND.search(span)
    if match and " " in span[match.end():].strip() + " ":
      found.append(([], span[match.start():].split('"')[0]))
  return found


def _argv(assignments: list[str], command: str) -> list[str]:
  """The command's words after shell expansion (i=0 for the loop variable of the two-process recipe)."""
  script = "\n".join(assignments + ["i=0", "printf '%s\\0' " + command])
  out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout
  return out.split("\0")[:-1]


def _documented() -> dict[str, list[list[str]]]:
  """{module: [argv, ...]} of every documented command."""
  by_module = {}
  for name in DOCS:
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
      text = f.read()
    for assignments, command in _snippets(text):
      words = _argv(assignments, command)
      assert words[:2] == ["python", "-m"], (name, command)
      by_module.setdefault(words[2], []).append(words[3:])
  return by_module


def test_documented_commands_parse():
  by_module = _documented()
  assert {"experiments.sink_analysis", "experiments.generate", "experiments.train", "converters.convert",
          "experiments.sink_masking_eval", "experiments.sink_token", "experiments.forward"} <= set(by_module)
  for module, commands in by_module.items():
    assert all("..." not in word for argv in commands for word in argv), (module, commands)
  parsed = {module: commands for module, commands in sorted(by_module.items()) if module not in NOT_ABSL}
  done = subprocess.run([sys.executable, "-c", _PARSE_DRIVER, os.path.join(ROOT, "tests"), json.dumps(parsed),
                         json.dumps(POSITIONAL)], cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  failures = json.loads(done.stdout.strip().splitlines()[-1])
  assert not failures, failures


@pytest.mark.parametrize("module", RUN_AS_WRITTEN)
def test_quick_commands_run_as_written(tmp_path, module):
  """The documented commands of `module` on the embedded models, run in a scratch working directory."""
  documented = _documented()

  def quick(name):
    return [argv for argv in documented.get(name, []) if any(w.endswith(("=tiny-dlm", "=tiny-arm")) for w in argv)]

  commands = quick(module)
  assert commands, module
  before = [(RUN_BEFORE[module], argv) for argv in quick(RUN_BEFORE[module])] if module in RUN_BEFORE else []
  cases = before + [(module, argv) for argv in commands]
  for (name, argv), (code, stderr, _) in zip(cases, fx.run_modules(cases, cwd=str(tmp_path), timeout=600)):
    assert code in (0, None), (name, argv, stderr[-3000:])
