r"""Would concatenated projection weights pay on CPU? Separate q/k/v and gate/up matmuls against one matmul
with the weights concatenated, at the denoising benchmark's shapes.

For each width D (MHA, N·H = D, MLP F = 3·D, S = 192 positions, batch 1) it times, jitted, with random
float32 inputs x [1, S, D]:
  qkv      separate: x·Wq, x·Wk, x·Wv (each [D, D]);   fused: x·[Wq Wk Wv] ([D, 3D]), one [1, S, 3D] array
           (its split is left to the consumers, as RoPE and attention would take slices in a model)
  gate/up  separate: SiLU(x·Wg) ⊙ x·Wu (each [D, F]); fused: x·[Wg Wu] ([D, 2F]) split, the same product
The two variants are timed alternately in one process (best of `--rounds` rounds of `--reps` calls), so
load from other processes hits both alike. XLA does not merge dots that share an operand on CPU, so the
fused variant is one larger GEMM. The model's parameter layout is not changed by this measurement.

    python -m benchmarks.projection_bench                                  # widths 128, 256, 512
    python -m benchmarks.projection_bench --xla_cpu_options=eigen
"""

from __future__ import annotations

import sys
import time

from absl import app, flags

from dlm_jax.runtime import xla_cpu

_WIDTHS = flags.DEFINE_list("widths", ["128", "256", "512"], "Model widths D.")
_SEQ = flags.DEFINE_integer("seq", 192, "Positions S (the benchmark's 64 prompt + 128 generated).")
_MLP_RATIO = flags.DEFINE_float("mlp_ratio", 3.0, "MLP width F / D.")
_REPS = flags.DEFINE_integer("reps", 50, "Calls per timed round.")
_ROUNDS = flags.DEFINE_integer("rounds", 7, "Timed rounds per variant (the best counts).")
_XLA_CPU_OPTIONS = flags.DEFINE_string("xla_cpu_options", "auto", "XLA CPU option set (dlm_jax.runtime.xla_cpu): "
                                       f"{'|'.join(xla_cpu.CHOICES)}.")


def projections(width: int, mlp: int):
  """{name: (separate, fused, separate args, fused args)}: jitted functions of x [1, S, D] and the weights.

  qkv: separate returns q, k, v [1, S, D] each, fused their concatenation [1, S, 3D]; gate/up: both return
  SiLU(x·Wg) ⊙ x·Wu [1, S, F].
  """
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  keys = jax.random.split(jax.random.key(0), 5)
  wq, wk, wv = (jax.random.normal(k, (width, width)) / width ** 0.5 for k in keys[:3])
  wg, wu = (jax.random.normal(k, (width, mlp)) / width ** 0.5 for k in keys[3:])
  wqkv, wgu = jnp.concatenate([wq, wk, wv], axis=1), jnp.concatenate([wg, wu], axis=1)

  def gate_up_fused(x, w):
    gate, up = jnp.split(x @ w, 2, axis=-1)
    return jax.nn.silu(gate) * up

  qkv_separate = jax.jit(lambda x, a, b, c: (x @ a, x @ b, x @ c))
  gate_up_separate = jax.jit(lambda x, g, u: jax.nn.silu(x @ g) * (x @ u))
  return {"qkv": (qkv_separate, jax.jit(lambda x, w: x @ w), (wq, wk, wv), (wqkv,)),
          "gate/up": (gate_up_separate, jax.jit(gate_up_fused), (wg, wu), (wgu,))}


def _best_seconds(fns, reps: int, rounds: int) -> list[float]:
  """Best time per call of each `fns[i]()` (block_until_ready), timed alternately."""
  import jax  # pylint: disable=import-outside-toplevel
  best = [float("inf")] * len(fns)
  for _ in range(rounds):
    for i, fn in enumerate(fns):
      start = time.perf_counter()
      for _ in range(reps):
        out = fn()
      jax.block_until_ready(out)
      best[i] = min(best[i], (time.perf_counter() - start) / reps)
  return best


def main(argv):
  del argv
  try:
    options = xla_cpu.apply(_XLA_CPU_OPTIONS.value)
  except ValueError as e:
    sys.exit(f"benchmarks.projection_bench: error: --xla_cpu_options={_XLA_CPU_OPTIONS.value}: {e}")
  import jax  # pylint: disable=import-outside-toplevel  (after XLA_FLAGS is set)
  import numpy as np  # pylint: disable=import-outside-toplevel
  print(f"CPU: {xla_cpu.cpu_info().model}; jax {jax.__version__}; XLA CPU options {options.name} "
        f"(XLA_FLAGS={options.xla_flags or '(empty)'})")
  print(f"{'width':>5} {'projection':>10} {'separate µs':>11} {'fused µs':>9} {'fused gain':>10}")
  for width in map(int, _WIDTHS.value):
    mlp = int(_MLP_RATIO.value * width)
    x = jax.random.normal(jax.random.key(1), (1, _SEQ.value, width))
    for name, (separate, fused, separate_args, fused_args) in projections(width, mlp).items():
      expected = np.concatenate(jax.tree.leaves(separate(x, *separate_args)), axis=-1)
      np.testing.assert_allclose(np.asarray(fused(x, *fused_args)), expected, rtol=1e-4, atol=1e-5)
      calls = [lambda f=separate, a=separate_args, x=x: f(x, *a), lambda f=fused, a=fused_args, x=x: f(x, *a)]
      times = _best_seconds(calls, _REPS.value, _ROUNDS.value)
      print(f"{width:>5} {name:>10} {1e6 * times[0]:>11.1f} {1e6 * times[1]:>9.1f} "
            f"{100 * (times[0] / times[1] - 1):>+9.1f}%", flush=True)


if __name__ == "__main__":
  app.run(main)
