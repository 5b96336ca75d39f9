# Three waves against four (the planner's two as the reference) on every preset and format, interleaved.
# nvidia-h200-x2. MEGAMOE_COMMIT must be set.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src
: "${MEGAMOE_COMMIT:?set it to the commit}"
ab() {  # preset precision variants
    timeout 150 python3 benchmarks/megakernel_ab.py --preset $1 --precision $2 --variants $3 --rounds 5 \
        --out $OUT/ab-$1-$2.json > $OUT/ab-$1-$2.txt 2>&1
    echo "== $1 $2"; tail -4 $OUT/ab-$1-$2.txt | cut -d'|' -f2,4,5
}
ab qwen3.5-397b bf16 12,12/5760,12/7680
ab qwen3.5-397b fp8-block 12,12/5760,12/7680
ab kimi-k2 bf16 8,8/3072,8/4096
ab kimi-k2 fp8-block 6,6/3072,6/4096
ab deepseek-v4-pro bf16 6,6/2048,6/2816
ab deepseek-v4-pro fp8-block 6,6/2048,6/2816
