#!/usr/bin/env bash
# Second kernel round on nvidia-h200-x2: new GPU tests, quantisers, FP8-block expert GEMMs, BF16 expert GEMMs
# (after the spill fixes, with the per-kernel backward profile) and the communication sweep.
# Usage (repo root): bash benchmarks/gpu_round2.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
export CUDA_VISIBLE_DEVICES=0
timeout 120 python3 -m pytest -q tests/test_experts.py tests/test_experts_fp8.py 2>&1 | tail -2
timeout 80 python3 benchmarks/quant_bench.py --out "$out/quant.json" > "$out/quant.log" 2>&1; tail -13 "$out/quant.log" | cut -c1-110
timeout 120 python3 benchmarks/experts_fp8_bench.py --out "$out/fp8.json" > "$out/fp8.log" 2>&1; tail -12 "$out/fp8.log"
timeout 100 python3 -m megamoe bench-experts --profile --json "$out/experts.json" 2>&1 | cut -c1-200 | tail -10
unset CUDA_VISIBLE_DEVICES
timeout 170 python3 benchmarks/comm_bench.py --out "$out" > "$out/comm_bench.log" 2>&1; tail -28 "$out/comm_bench.log"
