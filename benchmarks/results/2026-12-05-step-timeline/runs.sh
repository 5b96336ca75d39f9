#!/usr/bin/env bash
# Issue 49, step 1: a BF16 training step at EP 1 accounted per kernel, megamoe beside nccl-torch.
# Run on the GPU machine from the repository root; results under $OUT.
export PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p /tmp/tl
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv | tee /tmp/tl/gpu.txt
git rev-parse HEAD | tee /tmp/tl/commit.txt
for run in "qwen3-30b-a3b 8192" "qwen3-30b-a3b 16384" "deepseek-v3 8192" "kimi-k2 8192"; do
  set -- $run
  timeout 240 python3 benchmarks/backward_kernels.py --preset $1 --tokens $2 --pass step --steady 2 --rounds 3 \
    --top 14 --out /tmp/tl 2>&1 | grep -v Warning | tee -a /tmp/tl/log.txt
done
tar czf $OUT/step_timeline.tgz -C /tmp tl
grep -E "^(qwen|deep|kimi)|ms between|%" /tmp/tl/log.txt
