# call 4 (48445d7; NOT RUN: the device time ran out): today's defaults (fp8-block's BF16 wgrads below 384 rows an expert, mxfp8's always) at deepseek-v3 fp8-block and qwen3-30b-a3b bf16/fp8-block/mxfp8; qwen3 fp8-block forced to BF16 wgrads (MEGAMOE_FP8_BF16_WGRADS=1)
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd .gpu; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 280 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
nvidia-smi --query-gpu=name,power.limit,clocks.sm,memory.total --format=csv >> $L
B="python3 -m megamoe bench --ep 1 --impl megamoe --tokens 8192 --passes fwd,bwd,step --iters 5 --steady 1"
timeout $(cap 90) $B --experts fp8-block --preset deepseek-v3 --json $OUT/r/dsv3.json --md $OUT/r/dsv3.md > $OUT/r/dsv3.txt 2>&1; say "dsv3 fp8-block (defaults)" $?; grep -E "^\| (megamoe|nccl)" $OUT/r/dsv3.md >> $L || tail -3 $OUT/r/dsv3.txt >> $L
timeout $(cap 70) $B --experts bf16,fp8-block,mxfp8 --preset qwen3-30b-a3b --json $OUT/r/q.json --md $OUT/r/q.md > $OUT/r/q.txt 2>&1; say "qwen3 (defaults)" $?; grep -E "^\| (megamoe|nccl)" $OUT/r/q.md >> $L || tail -3 $OUT/r/q.txt >> $L
MEGAMOE_FP8_BF16_WGRADS=1 timeout $(cap 60) $B --experts bf16,fp8-block --preset qwen3-30b-a3b --json $OUT/r/q_w1.json --md $OUT/r/q_w1.md > $OUT/r/q_w1.txt 2>&1; say "qwen3 fp8-block bf16_wgrads=1" $?; grep -E "^\| (megamoe|nccl)" $OUT/r/q_w1.md >> $L || tail -3 $OUT/r/q_w1.txt >> $L
(cd $OUT && tar czf r.tgz r && rm -rf r)
grep -v "^\s*$" $L | tail -60
