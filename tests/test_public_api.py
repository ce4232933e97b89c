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


# The modules the layout step (3eafbfc) moved, as that commit's renames list them; written out here, not read
# from dlm_jax._moved_modules, so that a move dropped from the alias table fails this test.
LAYOUT_MOVES = {
    "dlm_jax.checkpoint": "dlm_jax.io.checkpoint", "dlm_jax.tokenizer": "dlm_jax.io.tokenizer",
    "dlm_jax.interventions": "dlm_jax.instrument.interventions", "dlm_jax.likelihood": "dlm_jax.analysis.likelihood",
    "dlm_jax.routing": "dlm_jax.analysis.routing", "dlm_jax.sinks": "dlm_jax.analysis.sinks",
    "dlm_jax.attention": "dlm_jax.model.attention", "dlm_jax.rope": "dlm_jax.model.rope",
    "dlm_jax.distributed": "dlm_jax.runtime.distributed", "dlm_jax.sharding": "dlm_jax.runtime.sharding",
    "dlm_jax.xla_cpu": "dlm_jax.runtime.xla_cpu", "dlm_jax.training_data": "dlm_jax.training.data",
    "dlm_jax.train_loop": "dlm_jax.training.loop", "dlm_jax.training_uniform": "dlm_jax.training.uniform",
}


@pytest.mark.parametrize("old,new", sorted(LAYOUT_MOVES.items()))
def test_old_import_paths_still_work_with_a_deprecation_warning(old, new, monkeypatch):
  monkeypatch.delitem(sys.modules, old, raising=False)
  with pytest.warns(DeprecationWarning, match=rf"^{old} moved to {new}; import it from there") as warned:
    __import__(old)  # an import statement's own call (importlib.import_module would add a frame of its own)
  alias = sys.modules[old]
  assert warned[0].filename == __file__  # the importing line, so a script shows it by default
  target = importlib.import_module(new)
  public = [name for name in vars(target) if not name.startswith("_")]
  assert public and all(getattr(alias, name) is getattr(target, name) for name in public)


def test_the_split_stats_module_forwards_to_both_halves(monkeypatch):
  from dlm_jax.instrument import stats  # pylint: disable=import-outside-toplevel
  from dlm_jax.sampling import stats_plan  # pylint: disable=import-outside-toplevel
  monkeypatch.delitem(sys.modules, "dlm_jax.stats", raising=False)
  with pytest.warns(DeprecationWarning, match="dlm_jax.instrument.stats and dlm_jax.sampling.stats_plan"):
    from dlm_jax.stats import StatsSpec, make_plan, squeeze_incoming  # pylint: disable=import-outside-toplevel
  assert (StatsSpec, make_plan, squeeze_incoming) == (stats.StatsSpec, stats_plan.make_plan, stats.squeeze_incoming)
  with pytest.raises(ImportError):
    from dlm_jax.stats import no_such_name  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
  with pytest.raises(ModuleNotFoundError):
    import dlm_jax.no_such_module  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
