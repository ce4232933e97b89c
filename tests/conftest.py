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
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _cache_dir = tempfile.mkdtemp(prefix="dlm_jax_test_xla_cache_")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
  atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
# Only programs that take a second or more to compile are written: the sampler and training programs that
# several files share (the small ones compile about as fast as they load).
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "1.0")
# A size limit turns on JAX's file lock around every cache read and write. Without it an entry is written in
# place, and a process reading the entry another one is still writing deserialises a torn executable (seen
# once here: a segfault in `compilation_cache.get_executable_and_time` with two workers compiling one program).
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(8 * 2**30))

import jax  # noqa: E402  (the environment must be set before JAX initialises)

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_default_matmul_precision", "highest")

import gc  # noqa: E402

import pytest  # noqa: E402


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
