#!/usr/bin/env bash
# The forward megakernel on nvidia-h200-x2: its GPU tests, kimi-k2 EP 2 and EP 1 (8192 tokens/GPU, BF16, forward)
# side by side with nccl-torch and unfused, and a trace of one pass. Usage (repo root):
#   MEGAMOE_COMMIT=$(git rev-parse --short=12 HEAD) bash benchmarks/gpu_megakernel.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv > "$out/nvidia-smi.txt" 2>&1
timeout 150 python3 -m pytest -q -x -m gpu tests/test_megakernel.py 2>&1 | tee "$out/pytest-gpu.log" | tail -3
timeout 120 python3 benchmarks/megakernel_trace.py --out "$out/trace.json" 2>&1 | tail -2
timeout 240 python3 -m megamoe bench --preset kimi-k2 --tokens 8192 --ep 2 --impl nccl-torch,unfused,megamoe,megamoe-graph \
    --passes fwd --iters 10 --json "$out/kimi-k2_ep2_fwd.json" --md "$out/kimi-k2_ep2_fwd.md" 2>&1 | tail -9
CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m megamoe bench --preset kimi-k2 --tokens 8192 --ep 1 \
    --impl nccl-torch,megamoe,megamoe-graph --passes fwd --iters 10 --json "$out/kimi-k2_ep1_fwd.json" \
    --md "$out/kimi-k2_ep1_fwd.md" 2>&1 | tail -8
