"""Test-wide JAX settings: CPU with 8 virtual devices (sharding tests), float32, highest matmul precision, and
one persistent compilation cache shared by every process of the run.

The suite is bound by XLA compilation, and many test files (and the binaries they start in subprocesses)
compile the same programs on the same tiny configs. `JAX_COMPILATION_CACHE_DIR` is set here, at import, in
the pytest process that starts first (the xdist controller), so the workers and every subprocess inherit
it and a program compiled once is loaded from disk by the others. The cache key covers the program, the
compile options, XLA_FLAGS, the devices and the JAX version, so a hit is the same executable. The
directory is created for this run and removed when it ends; a user's own `JAX_COMPILATION_CACHE_DIR` is
kept (and left in place). BUILD.md ("Test") has the measured effect.
"""

import atexit
import json
import os
import shutil
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _cache_dir = tempfile.mkdtemp(prefix="dlm_jax_test_xla_cache_")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
  atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
# Only programs that take 0.2 s or more to compile are written: the sampler, forward and training programs that
# several files and processes share (a tiny LLaDA sampler loads in 0.34 s where it compiles in 2.1 s); the
# eager one-operation programs below that are cheaper to compile again than to write and read (BUILD.md, "Test").
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
# A size limit turns on JAX's file lock around every cache read and write. Without it an entry is written in
# place, and a process reading the entry another one is still writing deserialises a torn executable (seen
# once here: a segfault in `compilation_cache.get_executable_and_time` with two workers compiling one program).
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(8 * 2**30))

# Profiling the suite (BUILD.md, "Measuring the suite"): every process of the run records its JAX compilations
# and times; subprocesses through tests/profiling/sitecustomize.py, found first on their PYTHONPATH.
_PROFILING = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiling")
if os.environ.get("DLM_JAX_SUITE_PROFILE"):
  os.makedirs(os.environ["DLM_JAX_SUITE_PROFILE"], exist_ok=True)  # the directory may be new
  os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_PROFILING, os.environ.get("PYTHONPATH")) if p)
  sys.path.insert(0, _PROFILING)
  import suite_events  # noqa: E402
else:
  suite_events = None

import jax  # noqa: E402  (the environment must be set before JAX initialises)

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_default_matmul_precision", "highest")

import gc  # noqa: E402

import pytest  # noqa: E402


_FILE_COSTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "file_costs.json")


def pytest_configure(config):
  """pytest-xdist orders test files by their number of tests by default; the suite orders them by cost."""
  if hasattr(config.option, "loadscopereorder"):
    config.option.loadscopereorder = False


def pytest_collection_modifyitems(session, config, items):
  """Runs the costliest test files first (tests/file_costs.json: measured CPU seconds per file; a file not
  listed yet counts as the median file), so that with `--dist loadfile` the two workers finish together
  instead of one waiting while the other runs a long file picked last. Tests keep their order in a file."""
  with open(_FILE_COSTS, encoding="utf-8") as f:
    costs = json.load(f)["cpu_seconds"]
  unknown = sorted(costs.values())[len(costs) // 2] if costs else 0.0
  items.sort(key=lambda item: -costs.get(item.nodeid.split("::")[0], unknown))


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """After each test file, drop JAX's in-memory caches of traced and compiled programs. Every compiled CPU
  executable keeps memory mappings of its machine code, and an xdist worker runs many files: with the caches
  kept, a worker of the full suite reached 60,770 mappings against Linux's vm.max_map_count of 65,530 and
  crashed inside XLA (a segfault in `executable.serialize()`, an abort in `backend_compile_and_load`, both
  late in the run). Programs a later file needs again come back from the persistent compilation cache."""
  yield
  jax.clear_caches()
  gc.collect()


if suite_events is not None:
  suite_events.install_jax_listeners()

  @pytest.hookimpl(hookwrapper=True)
  def pytest_runtest_protocol(item, nextitem):
    """Per test: wall seconds, this worker's CPU seconds and its finished subprocesses' CPU seconds."""
    wall, cpu = time.time(), suite_events.cpu_seconds()
    children = suite_events.cpu_seconds(suite_events.resource.RUSAGE_CHILDREN)
    yield
    suite_events.write({"kind": "test", "nodeid": item.nodeid, "wall": time.time() - wall,
                        "cpu": suite_events.cpu_seconds() - cpu,
                        "children_cpu": suite_events.cpu_seconds(suite_events.resource.RUSAGE_CHILDREN) - children})
