#!/usr/bin/env bash
# The megakernel's minibatch and comm_sms sweeps (kimi-k2, 8192 tokens/GPU, BF16, EP = every GPU) on
# nvidia-h200-x2. Usage (repo root): MEGAMOE_COMMIT=$(git rev-parse --short=12 HEAD) bash benchmarks/megakernel_sweep.sh OUTDIR [options]
# Extra options go to the script (e.g. --precision fp8-block, --minibatch 1024,2048). Writes OUTDIR/sweep.{json,md},
# the PNGs where matplotlib is installed (else: python3 benchmarks/megakernel_sweep.py --replot OUTDIR/sweep.json) and sweep.log.
set -u -o pipefail
out=${1:?output folder}
shift
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv > "$out/nvidia-smi.txt" 2>&1
timeout 570 python3 benchmarks/megakernel_sweep.py --impl megamoe --preset kimi-k2 --tokens 8192 --iters 20 --warmup 3 \
    --out "$out" "$@" 2>&1 | tee "$out/sweep.log" | tail -30
