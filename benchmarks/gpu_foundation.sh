#!/usr/bin/env bash
# The foundation's GPU checks and baseline numbers, on nvidia-h200-x2 (EP 1 uses one of its GPUs).
# Usage (repo root): bash benchmarks/gpu_foundation.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv | tee "$out/nvidia-smi.txt"
timeout 300 python3 -m pytest -q -m gpu tests 2>&1 | tee "$out/pytest-gpu.log" | tail -15
CUDA_VISIBLE_DEVICES=0 timeout 600 python3 -m megamoe bench --preset kimi-k2 --tokens 8192 --ep 1 \
    --json "$out/kimi-k2_ep1.json" --md "$out/kimi-k2_ep1.md" 2>&1 | tail -12
timeout 600 python3 -m megamoe bench --preset kimi-k2 --tokens 8192 --ep 2 \
    --json "$out/kimi-k2_ep2.json" --md "$out/kimi-k2_ep2.md" 2>&1 | tail -12
