#!/usr/bin/env bash
# GPU benchmark (one H200 or similar): dlm_jax vs the PyTorch way on LLaDA-8B-shaped random weights, bf16.
# Installs JAX (CUDA 12) and PyTorch, then runs the statistics-on condition (plus off and top-1 masking)
# at batch 1, 8 and 32 on a 1024-token sequence (512 prompt + 512 generated, blocks of 32), then the decoding
# modes (exact, threshold 0.9 / 0.7, prefix and dual cache, threshold + dual cache; statistics off and on) at
# batch 1 on 512 prompt + 256 generated tokens. Budget: < 10 min for the first part; the second is not yet
# measured on a GPU.
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
# Decoding modes at the LLaDA-8B shape, random weights: the threshold rule then commits about one token per call, so
# this measures each mode's cost per model call and the statistics' cost (accuracy needs the real checkpoint).
python -m benchmarks.decoding_modes_bench --checkpoint=random:llada-8b --n=1 --prompt_length=512 --gen_length=256 \
  --block_length=32 --dtype=bfloat16 --attention_impl=fused --json_out="$out/decoding_modes_bench_gpu.json" \
  2>&1 | tee "$out/decoding_modes_bench_gpu.log"
# Compute policies at the LLaDA-8B shape (32 layers, random weights): every call of every runnable policy (sparse_dllm,
# dkv_cache, sparsed, dllm_cache, elastic_cache, d2cache) against exact decoding and Fast-dLLM's dual cache (ms,
# analytic FLOPs checked against XLA's count of one layer), prompts 512 and 1024, each method's step under exact
# decoding, and the threshold figures derived from tiny-dlm's tokens per call. The chunked attention path: with
# bfloat16 weights the fused path refuses a call that reads a KV cache (float32 queries, bfloat16 cache).
python -m benchmarks.policy_bench --layers=32 --dtype=bfloat16 --attention_impl=chunked \
  --json_out="$out/policy_bench_gpu.json" 2>&1 | tee "$out/policy_bench_gpu.log"
