# qwen3.5-397b EP 2 at the planner's three-wave config: steady state beside nccl-torch, the schedule kernels, and a
# pass traced inside (bf16, fp8-block). nvidia-h200-x2. MEGAMOE_COMMIT must be set. At most 8 files under $OUT.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src
: "${MEGAMOE_COMMIT:?set it to the commit}"
p=qwen3.5-397b
timeout 200 python3 -m megamoe bench --preset $p --tokens 8192 --ep 2 --impl nccl-torch,megamoe,megamoe-graph \
    --experts bf16,fp8-block --passes fwd --iters 10 --warmup 60 --json $OUT/steady-$p.json --md $OUT/steady-$p.md \
    > /dev/null 2>/tmp/steady.err || tail -5 /tmp/steady.err
sed -n '6,12p' $OUT/steady-$p.md | cut -d'|' -f2,4,6,10
for f in bf16 fp8-block; do
    timeout 150 python3 benchmarks/megakernel_trace.py --preset $p --tokens 8192 --precision $f --passes 3 \
        --out $OUT/trace-$f.json 2>&1 | tail -12
done
timeout 100 python3 benchmarks/schedule_bench.py --out $OUT/schedule_bench.json 2>&1 | tail -22
