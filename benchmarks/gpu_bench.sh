#!/usr/bin/env bash
# GPU benchmark (one H200 or similar): dlm_jax vs the PyTorch way on LLaDA-8B-shaped random weights, bf16.
# Installs JAX (CUDA 12) and PyTorch, then runs the statistics-on condition (plus off and top-1 masking)
# at batch 1, 8 and 32 on a 1024-token sequence (512 prompt + 512 generated, blocks of 32). Budget: < 10 min.
#   bash benchmarks/gpu_bench.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu_bench_out}"
mkdir -p "$out"
python3 -m venv .venv-gpu && . .venv-gpu/bin/activate
python -m pip install -q -e . "jax[cuda12]" "torch>=2.5" "transformers==5.23.0"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
# 32 steps (one per block) keep the PyTorch batch-32 runs inside the budget; --steps=512 for the full schedule.
python -m benchmarks.denoise_bench --widths=4096 --layers=32 --heads=32 --vocab_size=126464 \
  --prompt_length=512 --gen_length=512 --block_length=32 --steps=32 --dtype=bfloat16 --attention_impl=fused \
  --batch_sizes=1,8,32 --conditions=stats,off,mask1 --memory_lengths= --json_out="$out/denoise_bench_gpu.json" \
  2>&1 | tee "$out/denoise_bench_gpu.log"
