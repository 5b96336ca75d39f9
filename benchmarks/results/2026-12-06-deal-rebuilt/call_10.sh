# call 10: the FP8-wgrad A/B above 1024 rows per expert (qwen3-30b-a3b at 32768 tokens: 2048 rows an expert): MEGAMOE_FP8_BF16_WGRADS=0 (FP8 wgrads) against 1 (BF16 wgrads), fp8-block and bf16 in each process, step passes
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd .gpu; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 200 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
nvidia-smi --query-gpu=name,power.limit,clocks.sm,memory.total --format=csv >> $L
B="python3 -m megamoe bench --ep 1 --impl megamoe --passes bwd,step --iters 5 --steady 1"
for w in 0 1; do
  MEGAMOE_FP8_BF16_WGRADS=$w timeout $(cap 90) $B --experts bf16,fp8-block --preset qwen3-30b-a3b --tokens 32768 --json $OUT/r/q32_w$w.json --md $OUT/r/q32_w$w.md > $OUT/r/q32_w$w.txt 2>&1; say q32_w$w $?; grep -E "^\| (megamoe|nccl)" $OUT/r/q32_w$w.md >> $L 2>/dev/null || tail -3 $OUT/r/q32_w$w.txt >> $L
done
(cd $OUT && tar czf r.tgz r && rm -rf r)
grep -v "^\s*$" $L | tail -30
