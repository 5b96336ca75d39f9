#!/usr/bin/env bash
# Steady-state forward passes of the three presets beside nccl-torch at EP=$EP (one rank per GPU), TOKENS per rank,
# BF16 and fp8-block routed experts. nvidia-h200-x4 for EP 4. MEGAMOE_COMMIT must be set. Usage (repo root):
#   EP=4 TOKENS=8192 [PRESETS="qwen3.5-397b ..."] MEGAMOE_COMMIT=$(git rev-parse --short=12 HEAD) OUT=DIR \
#       bash benchmarks/gpu_ep.sh
# Writes $OUT/ep$EP-$TOKENS-$preset.{json,md} (and .err when a bench fails); benchmarks/results/2026-11-30-ep4.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src
: "${MEGAMOE_COMMIT:?set it to the commit}" "${EP:?set EP}" "${TOKENS:?set TOKENS}" "${OUT:?set OUT to the output folder}"
mkdir -p "$OUT"
for p in ${PRESETS:-qwen3.5-397b kimi-k2 deepseek-v4-pro}; do
    name=ep$EP-$TOKENS-$p
    start=$SECONDS
    timeout ${BENCH_TIMEOUT:-180} python3 -m megamoe bench --preset $p --tokens $TOKENS --ep $EP \
        --impl nccl-torch,megamoe,megamoe-graph --experts bf16,fp8-block --passes fwd --iters 10 --warmup 60 \
        --json $OUT/$name.json --md $OUT/$name.md > /dev/null 2>$OUT/$name.err && rm $OUT/$name.err \
        || tail -5 $OUT/$name.err
    echo "# $name ($((SECONDS - start)) s): impl | ms (median) | x vs nccl-torch | rel | correct"
    sed -n '8,12p' $OUT/$name.md | cut -d'|' -f2,4,6,10,11
done
