# call 6 (again, at the rebuilt deal: the tag carries expert, task and rows; one descriptor site a deal end) (each shape's two settings one after the other, so a cut run still compares): the dynamic wgrad deal (MEGAMOE_WGRAD_DYNAMIC) against the static one: its GPU bit tests, then the backward per kernel under zipf and uniform routing at qwen3-30b-a3b 16384 and deepseek-v3 8192 tokens, each setting in its own process
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd .gpu; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 240 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
nvidia-smi --query-gpu=name,power.limit,clocks.sm,memory.total --format=csv >> $L
timeout $(cap 60) python3 -m pytest -v -m gpu tests/test_experts.py -k "wgrad_ws" -p no:cacheprovider > $OUT/r/t_wgrad.txt 2>&1; say t_wgrad $?; grep -E "PASSED|FAILED|ERROR|passed|failed" $OUT/r/t_wgrad.txt | tail -8 >> $L
K="python3 benchmarks/backward_kernels.py --impl megamoe --rounds 3 --steady 1 --pass bwd"
for args in "--preset qwen3-30b-a3b --tokens 16384 --routing zipf" "--preset qwen3-30b-a3b --tokens 16384" "--preset deepseek-v3 --routing zipf" "--preset deepseek-v3"; do
  for d in 0 1; do
    mkdir -p $OUT/r/d$d; n=bk_d${d}_$(echo $args | tr -d ' -' | cut -c1-40)
    MEGAMOE_WGRAD_DYNAMIC=$d timeout $(cap 70) $K --out $OUT/r/d$d $args > $OUT/r/$n.txt 2>&1; say "$n" $?; grep -E "wgrad_ws_kernel|between events" $OUT/r/$n.txt >> $L
  done
done
(cd $OUT && tar czf r.tgz r && rm -rf r)
grep -v "^\s*$" $L | tail -60
