#!/usr/bin/env bash
# FP8 rows quantised on arrival (the default) against quantised by their owners (KernelConfig.owner_quantize),
# kimi-k2 EP 2, 8192 tokens/GPU, forward, on nvidia-h200-x2: the planner's config in fp8-block and mxfp8, then
# a comm_sms sweep with owner quantisation (it needs fewer comm SMs if the copies are what limits them).
# Usage (repo root): MEGAMOE_COMMIT=$(git rev-parse --short=12 HEAD) bash benchmarks/gpu_owner_quantize.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
sweep() {  # name, extra args
  local name=$1; shift
  mkdir -p "$out/$name"
  timeout 150 python3 benchmarks/megakernel_sweep.py --impl megamoe --preset kimi-k2 --tokens 8192 --iters 10 \
      --warmup 2 --out "$out/$name" "$@" > "$out/$name/sweep.log" 2>&1
  tail -3 "$out/$name/sweep.log"
  rm -f "$out/$name"/*.png "$out/$name/sweep.md" "$out/$name/sweep.log"  # the device returns 8 files at most
}
timeout 150 python3 -m pytest -q -m gpu tests/test_megakernel.py -k owner 2>&1 | tail -2
for precision in fp8-block mxfp8; do
  sweep "$precision-arrival" --precision $precision --minibatch= --comm-sms=
  sweep "$precision-owner" --precision $precision --minibatch= --comm-sms= --owner-quantize
done
sweep fp8-block-owner-comm --precision fp8-block --minibatch= --comm-sms=6,8,10,12,16 --owner-quantize
