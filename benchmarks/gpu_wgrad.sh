#!/usr/bin/env bash
# The expert backward on one H200 (tile variants, per-kernel times), then the GPU tests of the schedule,
# world and megakernel. Usage (repo root): MEGAMOE_COMMIT=<hash> bash benchmarks/gpu_wgrad.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
CUDA_VISIBLE_DEVICES=0 timeout 300 python3 -m megamoe bench-experts --passes bwd --sweep --profile \
    --json "$out/experts-bwd.json" 2>&1 | tee "$out/experts-bwd.log" | tail -22
timeout 240 python3 -m pytest -q -m gpu tests/test_schedule.py tests/test_world.py tests/test_megakernel.py 2>&1 \
    | tee "$out/pytest-gpu.log" | tail -4
