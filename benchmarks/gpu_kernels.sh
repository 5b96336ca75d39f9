#!/usr/bin/env bash
# Standalone kernels on one H200: GPU tests, quantisers, expert GEMMs. Usage: bash benchmarks/gpu_kernels.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 240 python3 -m pytest -q -m gpu tests 2>&1 | tee "$out/pytest-gpu.log" | tail -6
CUDA_VISIBLE_DEVICES=0 timeout 150 python3 benchmarks/quant_bench.py --out "$out/quant.json" 2>&1 | tee "$out/quant.log" | tail -25
CUDA_VISIBLE_DEVICES=0 timeout 200 python3 benchmarks/experts_bench.py --out "$out/experts.json" 2>&1 | tail -25
