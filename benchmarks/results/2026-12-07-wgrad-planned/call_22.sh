# call 22: the planned wgrad deal as one region (a round's blocks side by side, a snake; .gpu/new) against the first plan (heavy and light blocks in turn from the order's two ends; .gpu/base = f1716b2), the static deal and the counter deal taken from one end (.gpu/new, MEGAMOE_WGRAD_DYNAMIC=1): GPU bits of the new tree, then the backward per kernel, each setting in its own process, settings alternated
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
G=$PWD/.gpu; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 560 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
nvidia-smi --query-gpu=name,power.limit,clocks.sm,memory.total --format=csv >> $L
cd $G/new
timeout $(cap 90) python3 -m pytest -v -m gpu tests/test_experts.py -k "wgrad_ws" -p no:cacheprovider > $OUT/r/t_wgrad.txt 2>&1; say t_wgrad $?; grep -E "FAILED|ERROR|passed|failed" $OUT/r/t_wgrad.txt | tail -6 >> $L
for v in PLANNED DYNAMIC; do
  env MEGAMOE_WGRAD_$v=1 timeout $(cap 50) python3 -m pytest -v -m gpu tests/test_experts.py -k "gathered_operands" -p no:cacheprovider > $OUT/r/t_gather_$v.txt 2>&1; say t_gather_$v $?; grep -E "FAILED|ERROR|passed|failed" $OUT/r/t_gather_$v.txt | tail -4 >> $L
done
K="python3 benchmarks/backward_kernels.py --impl megamoe --rounds 3 --steady 1 --pass bwd"
for load in "--preset qwen3-30b-a3b --tokens 16384" "--preset qwen3-30b-a3b --tokens 16384 --routing zipf" "--preset deepseek-v3" "--preset deepseek-v3 --routing zipf" "--preset sonic-7b --tokens 24576 --routing zipf"; do
  for s in new:1:0 base:1:0 new:0:0 new:0:1; do
    IFS=: read t d c <<< "$s"; cd $G/$t
    mkdir -p $OUT/r/$t$d$c; n=bk_${t}${d}${c}_$(echo $load | tr -d ' -' | cut -c1-40)
    MEGAMOE_WGRAD_PLANNED=$d MEGAMOE_WGRAD_DYNAMIC=$c timeout $(cap 45) $K --out $OUT/r/$t$d$c $load > $OUT/r/$n.txt 2>&1; say "$n" $?; grep -E "wgrad_ws_kernel|between events" $OUT/r/$n.txt >> $L
  done
done
(cd $OUT && tar czf r.tgz r && rm -rf r)
grep -v "^\s*$" $L | tail -60
