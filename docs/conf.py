"""Sphinx configuration of the dlm_jax documentation site (build: `python -m sphinx -W docs build/docs`).

The guides are the markdown files of docs/guides/ (MyST), all of them, found by the index's glob; the API
reference is generated from the docstrings of every public module of dlm_jax, found by walking the package
(`api_modules`), so a new guide or module appears without editing a list.
"""

from __future__ import annotations

import os
import pkgutil
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

try:
  import myst_parser  # noqa: F401  pylint: disable=unused-import
except ImportError:
  from sphinx.errors import ConfigError  # pylint: disable=ungrouped-imports
  from dlm_jax import extras
  raise ConfigError(extras.missing_message("The documentation site", "myst_parser", "docs")) from None

project = "dlm_jax"
author = "dlm_jax authors"
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
# table.md files are fragments of their summary.md (headings from H2).
exclude_patterns = ["_build", "results/**/table.md"]
myst_heading_anchors = 3
default_role = "code"
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": True, "ignore-module-all": True}
autodoc_member_order = "bysource"
autodoc_typehints = "none"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True
html_theme = "alabaster"
html_title = "dlm_jax"


def api_modules(package: str = "dlm_jax") -> list[str]:
  """Every public module of `package`, sorted: no name part starts with an underscore."""
  root = __import__(package)
  names = [package]
  for info in pkgutil.walk_packages(root.__path__, package + "."):
    if not any(part.startswith("_") for part in info.name.split(".")):
      names.append(info.name)
  return sorted(names)


def _api_source(app, docname: str, source: list[str]) -> None:
  """Appends one section per public module (an automodule directive) to the API page as it is read."""
  if docname != "api":
    return
  sections = []
  for name in api_modules():
    sections.append(f"\n## `{name}`\n\n```{{eval-rst}}\n.. automodule:: {name}\n```\n")
  source[0] += "".join(sections)


def _indent(line: str) -> int:
  return len(line) - len(line.lstrip())


def paragraph_breaks(lines: list[str]) -> list[str]:
  """The docstring with a blank line wherever the indentation changes between two adjacent lines.

  The docstrings are plain text with hanging indents ("name: meaning" and its indented continuation, a
  table under a sentence); reStructuredText needs a blank line at each such change. Literal blocks (the
  indented lines after a line ending in "::") are left as they are."""
  out: list[str] = []
  literal_at = None
  for line in lines:
    if literal_at is not None and (not line.strip() or _indent(line) > literal_at):
      out.append(line)
      continue
    literal_at = None
    previous = out[-1] if out else ""
    if line.strip() and previous.strip() and _indent(line) != _indent(previous):
      out.append("")
    out.append(line)
    if line.rstrip().endswith("::"):
      literal_at = _indent(line)
  return out


def _docstring_breaks(app, what, name, obj, options, lines: list[str]) -> None:
  lines[:] = paragraph_breaks(lines)


def setup(app):
  app.connect("source-read", _api_source)
  app.connect("autodoc-process-docstring", _docstring_breaks, priority=600)
