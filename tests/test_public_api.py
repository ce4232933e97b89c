"""`dlm_jax`'s public API: every name it states resolves to the object in its package, and importing the
package alone imports no JAX (the HumanEval sandbox imports `dlm_jax.tasks` in a bare interpreter)."""

import importlib
import subprocess
import sys

import pytest

import dlm_jax


@pytest.mark.parametrize("name", dlm_jax.__all__)
def test_every_public_name_resolves_to_its_package_object(name):
  module_name, attribute = dlm_jax._EXPORTS[name]  # pylint: disable=protected-access
  module = importlib.import_module(module_name)
  assert getattr(dlm_jax, name) is (module if attribute is None else getattr(module, attribute))


def test_unknown_names_raise_and_the_import_is_light():
  with pytest.raises(AttributeError, match="no attribute 'forwrd'"):
    dlm_jax.forwrd  # noqa: B018  pylint: disable=pointless-statement
  code = "import sys, dlm_jax, dlm_jax.tasks; print('jax' in sys.modules)"
  assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"
