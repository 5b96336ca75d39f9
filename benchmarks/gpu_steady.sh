# Steady-state forward passes of the three EP 2 presets beside nccl-torch (the planner's configs), then the GPU
# megakernel tests. nvidia-h200-x2. MEGAMOE_COMMIT must be set.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src
: "${MEGAMOE_COMMIT:?set it to the commit}"
for p in qwen3.5-397b kimi-k2 deepseek-v4-pro; do
    timeout 200 python3 -m megamoe bench --preset $p --tokens 8192 --ep 2 --impl nccl-torch,megamoe,megamoe-graph \
        --experts bf16,fp8-block --passes fwd --iters 10 --warmup 60 --json $OUT/steady-$p.json --md $OUT/steady-$p.md \
        > /dev/null 2>$OUT/steady-$p.err || tail -5 $OUT/steady-$p.err
    sed -n '6,12p' $OUT/steady-$p.md | cut -d'|' -f2,4,6,10
done
timeout 240 python3 -m pytest -q -m gpu tests/test_megakernel.py > $OUT/pytest-gpu-megakernel.log 2>&1; tail -2 $OUT/pytest-gpu-megakernel.log
