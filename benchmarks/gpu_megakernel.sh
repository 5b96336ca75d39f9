#!/usr/bin/env bash
# The forward megakernel on nvidia-h200-x2: its GPU tests, then kimi-k2 EP 2 (8192 tokens/GPU, BF16, forward)
# side by side with nccl-torch and unfused. Usage (repo root): bash benchmarks/gpu_megakernel.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv > "$out/nvidia-smi.txt" 2>&1
timeout 240 python3 -m pytest -q -x -m gpu tests/test_megakernel.py 2>&1 | tee "$out/pytest-gpu.log" | tail -25
timeout 300 python3 -m megamoe bench --preset kimi-k2 --tokens 8192 --ep 2 --impl nccl-torch,unfused,megamoe \
    --passes fwd --iters 10 --json "$out/kimi-k2_ep2_fwd.json" --md "$out/kimi-k2_ep2_fwd.md" 2>&1 | tail -8
