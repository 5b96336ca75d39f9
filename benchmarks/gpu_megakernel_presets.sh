#!/usr/bin/env bash
# The forward megakernel on three model shapes, EP 2 on nvidia-h200-x2, 8192 tokens/GPU, BF16, forward, against
# nccl-torch. Usage (repo root): MEGAMOE_COMMIT=$(git rev-parse --short=12 HEAD) bash benchmarks/gpu_megakernel_presets.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
for preset in kimi-k2 deepseek-v4-pro qwen3.5-397b; do
  timeout 170 python3 -m megamoe bench --preset $preset --tokens 8192 --ep 2 --impl nccl-torch,megamoe,megamoe-graph \
      --passes fwd --iters 10 --json "$out/${preset}_ep2_fwd.json" --md "$out/${preset}_ep2_fwd.md" 2>&1 | tail -7
done
