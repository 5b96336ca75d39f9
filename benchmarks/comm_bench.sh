#!/usr/bin/env bash
# megamoe.comm on nvidia-h200-x2: the GPU tests of tests/test_comm.py, then the three measurements.
# Usage (repo root): bash benchmarks/comm_bench.sh OUTDIR     (pytest <= 4 min, then the bench < 3 min)
set -u
out=${1:?output folder}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv > "$out/nvidia-smi.txt" 2>&1
timeout 240 python3 -m pytest -q -m gpu tests/test_comm.py 2>&1 | tee "$out/pytest-gpu-comm.log" | tail -4
timeout 200 python3 benchmarks/comm_bench.py --out "$out" 2>&1 | tee "$out/comm_bench.log" | tail -95
