"""The documentation site: it builds with warnings as errors, holds every guide and every public module, and
every ```python block of the guides (and README.md) runs as written — in order, one fresh namespace per
file, from the repository root."""

import glob
import importlib.util
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GUIDES = sorted(glob.glob(os.path.join(ROOT, "docs", "guides", "*.md")))
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _public_modules() -> list[str]:
  """Dotted names of the package's modules, none of whose name parts starts with an underscore."""
  names = []
  for directory, subdirs, files in os.walk(os.path.join(ROOT, "dlm_jax")):
    subdirs[:] = [d for d in subdirs if os.path.isfile(os.path.join(directory, d, "__init__.py"))]
    package = os.path.relpath(directory, ROOT).replace(os.sep, ".")
    if any(part.startswith("_") for part in package.split(".")):
      continue
    names += [package if f == "__init__.py" else f"{package}.{f[:-3]}" for f in files
              if f.endswith(".py") and (f == "__init__.py" or not f.startswith("_"))]
  return sorted(names)


def test_site_builds_without_warnings(tmp_path):
  out = tmp_path / "html"
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  done = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                         os.path.join(ROOT, "docs"), str(out), "-d", str(tmp_path / "doctrees")],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-5000:]
  for guide in GUIDES:
    page = out / "guides" / (os.path.basename(guide)[:-3] + ".html")
    assert page.is_file(), f"{guide} is not in the site"
  api = (out / "api.html").read_text(encoding="utf-8")
  missing = [name for name in _public_modules() if f'id="module-{name}"' not in api]
  assert not missing, f"modules missing from the API reference: {missing}"
  assert len(_public_modules()) > 20


def test_docstring_paragraph_breaks():
  """The conf.py hook adds a blank line at each indentation change, except inside a literal block (after
  which it adds one, as reStructuredText needs)."""
  spec = importlib.util.spec_from_file_location("docs_conf", os.path.join(ROOT, "docs", "conf.py"))
  conf = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(conf)
  lines = ["Intro:", "  step: the step,", "    continued.", "  tokens: ids.", "After.", "Code::", "",
           "    a = 1", "      b = 2", "    c = 3", "", "End."]
  assert conf.paragraph_breaks(lines) == [
      "Intro:", "", "  step: the step,", "", "    continued.", "", "  tokens: ids.", "", "After.", "Code::", "",
      "    a = 1", "      b = 2", "    c = 3", "", "End."]


def test_guides_exist():
  names = {os.path.basename(g) for g in GUIDES}
  assert {"quick_start.md", "sink_analysis.md", "figures.md", "converting_checkpoints.md",
          "samplers.md", "statistics_and_interventions.md", "scaling_out.md", "reproducing_papers.md",
          "adding_a_model_family.md"} <= names


@pytest.mark.parametrize("path", [os.path.join(ROOT, "README.md")] + GUIDES,
                         ids=lambda p: os.path.relpath(p, ROOT))
def test_python_blocks_run(path, monkeypatch):
  with open(path, encoding="utf-8") as f:
    text = f.read()
  monkeypatch.chdir(ROOT)
  namespace = {"__name__": "__main__"}
  for number, match in enumerate(PYTHON_BLOCK.finditer(text), start=1):
    line = text.count("\n", 0, match.start()) + 1
    code = compile(match.group(1), f"{os.path.relpath(path, ROOT)}:{line} (block {number})", "exec")
    exec(code, namespace)  # pylint: disable=exec-used
