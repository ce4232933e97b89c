"""Choosing XLA CPU option sets: CPU identification, `auto`, merging with the user's XLA_FLAGS, the errors."""

import os
import subprocess
import sys

import pytest

from dlm_jax.runtime import xla_cpu
from experiments.common.cli import UserError
from experiments.common.devices import RuntimeSettings

_CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu avx512f

processor\t: 1
vendor_id\t: AuthenticAMD
model name\t: something else
"""


def test_cpu_info_reads_the_first_processor(tmp_path):
  path = tmp_path / "cpuinfo"
  path.write_text(_CPUINFO)
  assert xla_cpu.cpu_info(str(path)) == xla_cpu.CpuInfo(model="Intel(R) Xeon(R) Processor", vendor="GenuineIntel")
  missing = xla_cpu.cpu_info(str(tmp_path / "none"))
  assert missing.model and missing.vendor == "unknown"


def test_auto_follows_the_vendor_table_and_named_sets_are_themselves(monkeypatch):
  monkeypatch.setattr(xla_cpu, "AUTO_BY_VENDOR", {"GenuineIntel": "eigen"})
  assert xla_cpu.resolve("auto", "GenuineIntel") == "eigen"
  assert xla_cpu.resolve("auto", "AuthenticAMD") == "default"
  assert all(xla_cpu.resolve(name, "GenuineIntel") == name for name in xla_cpu.OPTION_SETS)
  assert set(xla_cpu.CHOICES) == {"auto", *xla_cpu.OPTION_SETS}
  assert set(xla_cpu.AUTO_BY_VENDOR.values()) <= set(xla_cpu.OPTION_SETS)


def test_an_unknown_set_is_a_one_line_error():
  with pytest.raises(ValueError, match="unknown XLA CPU option set 'fast'; expected one of auto, default") as e:
    xla_cpu.resolve("fast", "GenuineIntel")
  assert "\n" not in str(e.value)
  with pytest.raises(UserError, match=r"--xla_cpu_options=fast: expected one of auto, default") as e:
    RuntimeSettings(xla_cpu_options="fast")
  assert "\n" not in str(e.value)
  assert RuntimeSettings().xla_cpu_options == "auto"


def test_the_users_own_xla_flags_win():
  assert xla_cpu.merged_xla_flags("default", "") == ""
  assert xla_cpu.merged_xla_flags("eigen", "") == "--xla_cpu_experimental_ynn_fusion_type="
  assert xla_cpu.merged_xla_flags("eigen", " --xla_dump_to=/tmp/d ") == (
      "--xla_dump_to=/tmp/d --xla_cpu_experimental_ynn_fusion_type=")
  assert xla_cpu.flag_entries("ynn_fused") == (
      "--xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_DOT,LIBRARY_FUSION_TYPE_ELTWISE",)
  assert xla_cpu.flag_entries("onednn") == (
      "--xla_cpu_experimental_ynn_fusion_type=", "--xla_cpu_use_onednn=true",
      "--xla_cpu_experimental_onednn_fusion_type=LIBRARY_FUSION_TYPE_DOT")
  user = "--xla_cpu_experimental_ynn_fusion_type=dot --xla_cpu_use_onednn=false"
  assert xla_cpu.merged_xla_flags("onednn", user) == (
      f"{user} --xla_cpu_experimental_onednn_fusion_type=LIBRARY_FUSION_TYPE_DOT")


def test_apply_sets_xla_flags_and_refuses_once_a_backend_exists(monkeypatch):
  import jax  # pylint: disable=import-outside-toplevel
  jax.devices()  # this test process has a backend, as every process does after its first JAX call
  intel = xla_cpu.CpuInfo(model="x", vendor="GenuineIntel")
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_experimental_ynn_fusion_type=")
  applied = xla_cpu.apply("eigen", intel)  # nothing to add: allowed
  assert applied == xla_cpu.XlaCpuOptions(choice="eigen", name="eigen", flags=xla_cpu.flag_entries("eigen"),
                                          xla_flags="--xla_cpu_experimental_ynn_fusion_type=")
  monkeypatch.delenv("XLA_FLAGS")
  assert xla_cpu.apply("default", intel).xla_flags == ""
  with pytest.raises(RuntimeError, match="before JAX creates a backend"):
    xla_cpu.apply("onednn", intel)


_CHECK_SET = """
import re, sys
import numpy as np
from dlm_jax.runtime import xla_cpu
options = xla_cpu.apply(sys.argv[1])
import jax
a = np.random.default_rng(0).standard_normal((64, 96), dtype=np.float32)
f = jax.jit(lambda x: jax.nn.silu(x @ x.T))
product = np.asarray(f(a))
expected = a.astype(np.float64) @ a.T.astype(np.float64)
np.testing.assert_allclose(product, expected / (1 + np.exp(-expected)), rtol=1e-5, atol=1e-4)
print(options.xla_flags)
print(" ".join(sorted(set(re.findall(r"%(ynn|onednn)_fusion", f.lower(a).compile().as_text())))))
"""

_LIBRARIES = {"default": "ynn", "eigen": "", "ynn_fused": "ynn", "onednn": "onednn"}
"""The library fusions each set's compiled matmul contains in jaxlib 0.10.2 (empty: XLA's own dot)."""


@pytest.mark.parametrize("name", sorted(xla_cpu.OPTION_SETS))
def test_every_set_runs_a_matmul_through_xla_flags_with_its_library(name):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  done = subprocess.run([sys.executable, "-c", _CHECK_SET, name], capture_output=True, text=True, check=False,
                        env=env, timeout=300)
  assert done.returncode == 0, done.stderr[-2000:]  # an unknown flag name aborts the process
  xla_flags, libraries = (done.stdout.splitlines() + ["", ""])[:2]
  assert xla_flags == " ".join(xla_cpu.flag_entries(name))
  assert libraries == _LIBRARIES[name]


@pytest.mark.parametrize("name", sorted(xla_cpu.OPTION_SETS))
def test_every_set_is_accepted_as_compiler_options(name):
  """The form the denoising benchmark's option comparison uses (one process, one compilation per set)."""
  import re  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  a = np.random.default_rng(0).standard_normal((64, 96), dtype=np.float32)
  compiled = jax.jit(lambda x: jax.nn.silu(x @ x.T)).lower(a).compile(
      compiler_options=xla_cpu.OPTION_SETS[name] or None)
  assert " ".join(sorted(set(re.findall(r"%(ynn|onednn)_fusion", compiled.as_text())))) == _LIBRARIES[name]
  expected = a.astype(np.float64) @ a.T.astype(np.float64)
  np.testing.assert_allclose(np.asarray(compiled(a)), expected / (1 + np.exp(-expected)), rtol=1e-5, atol=1e-4)
