#!/usr/bin/env bash
# The forward megakernel's GPU tests, then kimi-k2 EP 2 (8192 tokens/GPU, forward) at the planner's config in each
# precision (bf16, fp8-block, mxfp8), eager passes, on nvidia-h200-x2. Usage (repo root):
#   MEGAMOE_COMMIT=$(git rev-parse --short=12 HEAD) bash benchmarks/gpu_precisions.sh OUTDIR
# Writes OUTDIR/pytest-gpu.log and OUTDIR/<precision>/sweep.{json,md,log}.
set -u
out=${1:?output folder}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv > "$out/nvidia-smi.txt" 2>&1
timeout 200 python3 -m pytest -q -m gpu tests/test_megakernel.py tests/test_comm.py 2>&1 | tee "$out/pytest-gpu.log" | tail -3
for precision in bf16 fp8-block mxfp8; do
  mkdir -p "$out/$precision"
  # one point: the planner's config (the sweep adds it to each one-knob list)
  timeout 150 python3 benchmarks/megakernel_sweep.py --impl megamoe --preset kimi-k2 --tokens 8192 --iters 10 --warmup 2 \
      --precision $precision --minibatch '' --comm-sms '' --out "$out/$precision" 2>&1 | tee "$out/$precision/sweep.log" | tail -6
done
