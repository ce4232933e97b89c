r"""Peak resident memory of converters.convert on a synthetic multi-GB LLaDA-format checkpoint.

  python -m benchmarks.convert_memory_bench [--d_model=2048 --n_layers=8 --mlp_hidden=5632 --vocab=32000]
      [--source_dtype=float32] [--out_dtype=bfloat16] [--json_out=FILE]

Builds the checkpoint (OLMo names, sharded with an index, written a block at a time) in a temporary
directory, runs the converter CLI in a subprocess and reads that child's peak RSS (`ru_maxrss` from
`getrusage(RUSAGE_CHILDREN)`). A second child that only imports the
converter gives the constant (Python + JAX + numpy). Printed and written as JSON: peak RSS, the import
baseline, the largest output tensor, and the ratios. The temporary directory is removed at the end.

Each child is started from a minimal launcher that reads `getrusage(RUSAGE_CHILDREN).ru_maxrss`:
Linux folds the high-water RSS of the process that forks into the child's, so measuring directly
from this process (which has imported JAX) would report this process's size instead.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
from absl import app, flags

from dlm_jax.io.checkpoint import SAFETENSORS_DTYPES, SafetensorsWriter, expected_tensors
from dlm_jax.config import ModelConfig

_D_MODEL = flags.DEFINE_integer("d_model", 2048, "Hidden size.")
_N_LAYERS = flags.DEFINE_integer("n_layers", 8, "Blocks.")
_N_HEADS = flags.DEFINE_integer("n_heads", 16, "Heads (MHA, as LLaDA).")
_MLP_HIDDEN = flags.DEFINE_integer("mlp_hidden", 5632, "SwiGLU width.")
_VOCAB = flags.DEFINE_integer("vocab", 32000, "Vocabulary rows.")
_SOURCE_DTYPE = flags.DEFINE_enum("source_dtype", "float32", ("float32", "bfloat16"), "Synthetic checkpoint dtype.")
_OUT_DTYPE = flags.DEFINE_enum("out_dtype", "bfloat16", ("bfloat16", "float32"), "Converted dtype.")
_CHUNK_MB = flags.DEFINE_integer("chunk_mb", 64, "Converter block size (passed through).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Parent of the temporary directory (default: system temp).")
_JSON_OUT = flags.DEFINE_string("json_out", os.path.join(tempfile.gettempdir(), "convert_memory_bench.json"),
                                "Where to write the results.")

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_NP_DTYPES = {"float32": "F32", "bfloat16": "BF16"}


def llada_tensors(d: int, layers: int, f: int, vocab: int) -> dict[str, tuple[int, ...]]:
  """LLaDA/OLMo tensor names and torch shapes ([out, in]) of an MHA model without biases."""
  shapes = {"model.transformer.wte.weight": (vocab, d), "model.transformer.ln_f.weight": (d,),
            "model.transformer.ff_out.weight": (vocab, d)}
  for n in range(layers):
    block = f"model.transformer.blocks.{n}."
    shapes.update({block + "attn_norm.weight": (d,), block + "ff_norm.weight": (d,)})
    shapes.update({block + f"{n}.weight": (d, d) for n in ("q_proj", "k_proj", "v_proj", "attn_out")})
    shapes.update({block + "ff_proj.weight": (f, d), block + "up_proj.weight": (f, d), block + "ff_out.weight": (d, f)})
  return shapes


def write_synthetic_checkpoint(directory: str, dtype: np.dtype) -> int:
  """Writes config.json and sharded safetensors (pseudo-random values, 64 MiB at a time); returns bytes."""
  d, layers, f, vocab = _D_MODEL.value, _N_LAYERS.value, _MLP_HIDDEN.value, _VOCAB.value
  config = dict(model_type="llada", architectures=["LLaDAModelLM"], d_model=d, n_layers=layers,
                n_heads=_N_HEADS.value, n_kv_heads=_N_HEADS.value, mlp_hidden_size=f, vocab_size=vocab,
                embedding_size=vocab, weight_tying=False, block_type="llama", rms_norm_eps=1e-5, rope_theta=500000.0,
                rope_full_precision=True, include_bias=False, include_qkv_bias=False, mask_token_id=vocab - 1,
                eos_token_id=1, pad_token_id=1)
  with open(os.path.join(directory, "config.json"), "w") as fh:
    json.dump(config, fh, indent=2)
  shapes = llada_tensors(d, layers, f, vocab)
  pool = (np.random.default_rng(0).standard_normal(1 << 22) * 0.02).astype(dtype)  # 4M values, reused
  total = 0
  with SafetensorsWriter(directory, {n: (s, dtype) for n, s in shapes.items()}, max_shard_bytes=1 << 30) as writer:
    for k, (name, shape) in enumerate(shapes.items()):
      rows_per_block = max(1, (64 << 20) // (math.prod(shape[1:]) * dtype.itemsize))
      for r0 in range(0, shape[0], rows_per_block):
        rows = min(rows_per_block, shape[0] - r0)
        count = rows * math.prod(shape[1:])
        block = np.resize(np.roll(pool, k * 7919 + r0), count).reshape((rows,) + shape[1:])
        writer.write(name, block, at=(r0,))
      total += math.prod(shape) * dtype.itemsize
  return total


# The child's ru_maxrss would include this (JAX-importing) process's high-water mark, which Linux carries
# across fork+exec; a bare launcher keeps that floor at a few MiB and reports RUSAGE_CHILDREN itself.
_LAUNCHER = ("import resource, subprocess, sys\n"
             "code = subprocess.call(sys.argv[1:], stdout=subprocess.DEVNULL)\n"
             "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
             "sys.exit(code)\n")


def run_child(args: list[str]) -> tuple[int, float, float, str]:
  """Runs `python args...` from the repo root; returns (exit code, peak RSS bytes, seconds, stderr tail)."""
  start = time.perf_counter()
  result = subprocess.run([sys.executable, "-c", _LAUNCHER, sys.executable, *args], cwd=_REPO,
                          capture_output=True, text=True)
  peak = float(result.stdout.split()[-1]) * 1024.0 if result.stdout.split() else float("nan")
  return result.returncode, peak, time.perf_counter() - start, result.stderr[-2000:]


def main(argv: list[str]) -> None:
  del argv
  source_dtype = SAFETENSORS_DTYPES[_NP_DTYPES[_SOURCE_DTYPE.value]]
  out_dtype = SAFETENSORS_DTYPES[_NP_DTYPES[_OUT_DTYPE.value]]
  work = tempfile.mkdtemp(prefix="convert_memory_bench-", dir=_WORKDIR.value)
  try:
    hf_dir, out_dir = os.path.join(work, "hf"), os.path.join(work, "out")
    os.mkdir(hf_dir)
    start = time.perf_counter()
    source_bytes = write_synthetic_checkpoint(hf_dir, source_dtype)
    print(f"synthetic checkpoint: {source_bytes / 1e9:.2f} GB in {time.perf_counter() - start:.1f}s")
    code, baseline, _, tail = run_child(["-c", "import converters.hf_convert"])
    assert code == 0, tail
    code, peak, seconds, tail = run_child(
        ["-m", "converters.convert", f"--hf_dir={hf_dir}", f"--out_dir={out_dir}", f"--dtype={_OUT_DTYPE.value}",
         f"--chunk_mb={_CHUNK_MB.value}"])
    assert code == 0, tail
    with open(os.path.join(out_dir, "config.json")) as fh:
      config = ModelConfig.from_json(fh.read())
    shapes = expected_tensors(config)
    largest_name = max(shapes, key=lambda n: math.prod(shapes[n]))
    largest = math.prod(shapes[largest_name]) * out_dtype.itemsize
    out_bytes = sum(os.path.getsize(os.path.join(out_dir, f)) for f in os.listdir(out_dir))
    result = dict(
        d_model=_D_MODEL.value, n_layers=_N_LAYERS.value, mlp_hidden=_MLP_HIDDEN.value, vocab=_VOCAB.value,
        source_dtype=_SOURCE_DTYPE.value, out_dtype=_OUT_DTYPE.value, chunk_mb=_CHUNK_MB.value,
        source_bytes=source_bytes, output_bytes=out_bytes, convert_seconds=round(seconds, 2),
        peak_rss_bytes=int(peak), import_baseline_rss_bytes=int(baseline), largest_output_tensor=largest_name,
        largest_output_tensor_shape=list(shapes[largest_name]), largest_output_tensor_bytes=largest,
        peak_over_largest=round(peak / largest, 3),
        peak_minus_baseline_over_largest=round((peak - baseline) / largest, 3))
    mb = lambda b: f"{b / 2**20:.0f} MiB"
    print(f"converted {source_bytes / 1e9:.2f} GB ({_SOURCE_DTYPE.value}) -> {out_bytes / 1e9:.2f} GB "
          f"({_OUT_DTYPE.value}) in {seconds:.1f}s")
    print(f"peak RSS {mb(peak)}; import-only baseline {mb(baseline)}; largest output tensor {largest_name} "
          f"{list(shapes[largest_name])} = {mb(largest)}")
    print(f"peak / largest = {peak / largest:.2f}; (peak - baseline) / largest = {(peak - baseline) / largest:.2f}")
    with open(_JSON_OUT.value, "w") as fh:
      json.dump(result, fh, indent=2)
    print(f"wrote {_JSON_OUT.value}")
  finally:
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
  app.run(main)
