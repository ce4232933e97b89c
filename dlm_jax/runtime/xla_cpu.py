"""XLA's CPU compiler options as named sets, put into XLA_FLAGS before JAX creates its first backend.

XLA reads XLA_FLAGS once, when the first backend is created (the first JAX call that touches a device),
so `apply` must run before that; importing jax is fine. A set is also usable for one compilation,
`jax.jit(f).lower(...).compile(compiler_options=OPTION_SETS[name])` (the same DebugOptions fields), which
is how the denoising benchmark compares them in one process. The sets change which library runs the CPU
matmuls, which changes float rounding only (BUILD.md has the measurements behind `auto`).

The option names and values are those of jaxlib 0.10.2 (an unknown name in XLA_FLAGS aborts the process;
`tests/test_xla_cpu.py` runs every set). Fusion types are written as enum names (LIBRARY_FUSION_TYPE_DOT):
XLA_FLAGS also takes the short names (dot), `compiler_options` only the enum names.

  default    XLA's own choice: in jaxlib 0.10 every dot is a YNNPACK fusion of its own
  eigen      YNNPACK fusions off, so dots go through XLA's Eigen matmul
  ynn_fused  YNNPACK fusions of dots together with the elementwise ops around them
  onednn     YNNPACK fusions off, oneDNN dot fusions on (matmuls through oneDNN)
  auto       the set measured fastest on this CPU vendor (`AUTO_BY_VENDOR`), else default

XNNPACK's options (xla_cpu_experimental_xnn_fusion_type, xla_cpu_experimental_xnn_graph_fusion_mode) are
accepted by this jaxlib but produced no XNNPACK fusion in any compiled program we tried, so no set uses them.
Flags the user already put into XLA_FLAGS win: a set's flag whose name is there is not added.
"""

from __future__ import annotations

import dataclasses
import os
import platform

_YNN = "xla_cpu_experimental_ynn_fusion_type"

OPTION_SETS: dict[str, dict[str, bool | str]] = {
    "default": {},
    "eigen": {_YNN: ""},
    "ynn_fused": {_YNN: "LIBRARY_FUSION_TYPE_DOT,LIBRARY_FUSION_TYPE_ELTWISE"},
    "onednn": {_YNN: "", "xla_cpu_use_onednn": True,
               "xla_cpu_experimental_onednn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"},
}
"""Named sets: XLA DebugOptions field -> value (typed, as `compiler_options` wants them)."""

AUTO_BY_VENDOR: dict[str, str] = {"GenuineIntel": "default", "AuthenticAMD": "default"}
"""/proc/cpuinfo vendor_id -> the set `auto` picks on it (vendors not listed get default). BUILD.md decision
18: on an Intel Xeon (2026-12-01) no set beat XLA's default beyond the run-to-run noise, and the AMD EPYC
already ran 1.5-2.1x the PyTorch way with it, unmeasured with the other sets, so both keep default."""

CHOICES = ("auto", *OPTION_SETS)
"""The values `--xla_cpu_options` accepts."""


@dataclasses.dataclass(frozen=True)
class CpuInfo:
  """The CPU as /proc/cpuinfo names it: `model` ("model name"), `vendor` ("vendor_id", e.g. GenuineIntel)."""

  model: str
  vendor: str


@dataclasses.dataclass(frozen=True)
class XlaCpuOptions:
  """What `apply` did: the requested `choice`, the set `name` it resolved to, that set's XLA_FLAGS entries
  `flags` (`flag_entries`), and the process's `xla_flags` afterwards (the user's own entries included)."""

  choice: str
  name: str
  flags: tuple[str, ...]
  xla_flags: str


def cpu_info(path: str = "/proc/cpuinfo") -> CpuInfo:
  """The first processor's model name and vendor; `platform` fallbacks where the file is missing."""
  fields = {}
  if os.path.exists(path):
    with open(path) as f:
      for line in f:
        if not line.strip():
          break
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
  return CpuInfo(model=fields.get("model name") or platform.processor() or platform.machine() or "unknown",
                 vendor=fields.get("vendor_id", "unknown"))


def resolve(choice: str, vendor: str) -> str:
  """The named set `choice` means on a CPU of `vendor`; ValueError (one line) for an unknown choice."""
  if choice not in CHOICES:
    raise ValueError(f"unknown XLA CPU option set {choice!r}; expected one of {', '.join(CHOICES)}")
  if choice == "auto":
    return AUTO_BY_VENDOR.get(vendor, "default")
  return choice


def flag_entries(name: str) -> tuple[str, ...]:
  """The XLA_FLAGS entries of set `name`, e.g. ("--xla_cpu_use_onednn=true", ...)."""
  return tuple(f"--{option}={str(value).lower() if isinstance(value, bool) else value}"
               for option, value in OPTION_SETS[name].items())


def merged_xla_flags(name: str, existing: str) -> str:
  """`existing` XLA_FLAGS with the entries of set `name` appended, except those whose flag it already has."""
  given = {entry.split("=", 1)[0] for entry in existing.split()}
  added = [entry for entry in flag_entries(name) if entry.split("=", 1)[0] not in given]
  return " ".join([*existing.split(), *added])


def apply(choice: str, cpu: CpuInfo | None = None) -> XlaCpuOptions:
  """Resolves `choice` (one of `CHOICES`) for `cpu` (default: this machine's) and sets XLA_FLAGS.

  Raises ValueError for an unknown choice, RuntimeError when a set with flags is asked for after JAX
  created a backend (XLA would silently ignore it).
  """
  name = resolve(choice, (cpu or cpu_info()).vendor)
  existing = os.environ.get("XLA_FLAGS", "")
  merged = merged_xla_flags(name, existing)
  if merged != " ".join(existing.split()):
    from jax._src import xla_bridge  # pylint: disable=import-outside-toplevel  (no public equivalent)
    if xla_bridge.backends_are_initialized():
      raise RuntimeError(f"XLA CPU options {name!r} must be applied before JAX creates a backend")
    os.environ["XLA_FLAGS"] = merged
  return XlaCpuOptions(choice=choice, name=name, flags=flag_entries(name), xla_flags=os.environ.get("XLA_FLAGS", ""))
