# Pushes by row tile: GPU tests (megakernel, schedule, FP8/MXFP8 experts), qwen3.5-397b traces (the drain after the
# last compute worker) and its steady state beside nccl-torch. nvidia-h200-x2. MEGAMOE_COMMIT must be set.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src
: "${MEGAMOE_COMMIT:?set it to the commit}"
p=qwen3.5-397b
timeout 280 python3 -m pytest -q -m gpu tests/test_megakernel.py tests/test_schedule.py tests/test_experts_fp8.py \
    tests/test_experts_mxfp8.py > $OUT/pytest-gpu.log 2>&1; tail -2 $OUT/pytest-gpu.log
for f in bf16 fp8-block; do
    timeout 120 python3 benchmarks/megakernel_trace.py --preset $p --tokens 8192 --precision $f --passes 3 \
        --out $OUT/trace-$f.json 2>&1 | grep "kernel_ms" | sed 's/standalone experts [^|]*|//'
done
timeout 200 python3 -m megamoe bench --preset $p --tokens 8192 --ep 2 --impl nccl-torch,megamoe,megamoe-graph \
    --experts bf16,fp8-block --passes fwd --iters 10 --warmup 60 --json $OUT/steady-$p.json --md $OUT/steady-$p.md \
    > /dev/null 2>/tmp/steady.err || tail -5 /tmp/steady.err
sed -n '6,12p' $OUT/steady-$p.md | cut -d'|' -f2,4,6,10
