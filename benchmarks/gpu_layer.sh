#!/usr/bin/env bash
# Layer-level run on nvidia-h200-x2: every GPU test, then kimi-k2 EP 2 nccl-torch vs unfused, then the
# expert-GEMM backward profile. Usage (repo root): bash benchmarks/gpu_layer.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 200 python3 -m pytest -q -m gpu tests 2>&1 | tee "$out/pytest-gpu.log" | tail -4
timeout 200 python3 -m pytest -q tests/test_experts.py 2>&1 | tail -2
timeout 240 python3 -m megamoe bench --preset kimi-k2 --tokens 8192 --ep 2 --impl nccl-torch,unfused --iters 10 \
    --json "$out/kimi-k2_ep2_layer.json" --md "$out/kimi-k2_ep2_layer.md" 2>&1 | tail -8
CUDA_VISIBLE_DEVICES=0 timeout 150 python3 benchmarks/quant_bench.py --out "$out/quant.json" 2>&1 | tee "$out/quant.log" | tail -14
CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m megamoe bench-experts --profile --json "$out/experts.json" 2>&1 | tail -12
