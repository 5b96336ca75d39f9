# call 22: the planned wgrad deal as one region (a round's blocks side by side, a snake; .gpu/new) against the first plan (heavy and light blocks in turn from the order's two ends; .gpu/base = f1716b2) and the static deal: GPU bits of the new tree, then the backward per kernel, each setting in its own process, settings alternated
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
G=$PWD/.gpu; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 540 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
nvidia-smi --query-gpu=name,power.limit,clocks.sm,memory.total --format=csv >> $L
cd $G/new
timeout $(cap 90) python3 -m pytest -v -m gpu tests/test_experts.py -k "wgrad_ws" -p no:cacheprovider > $OUT/r/t_wgrad.txt 2>&1; say t_wgrad $?; grep -E "FAILED|ERROR|passed|failed" $OUT/r/t_wgrad.txt | tail -6 >> $L
MEGAMOE_WGRAD_PLANNED=1 timeout $(cap 50) python3 -m pytest -v -m gpu tests/test_experts.py -k "gathered_operands" -p no:cacheprovider > $OUT/r/t_gather_planned.txt 2>&1; say t_gather_planned $?; grep -E "FAILED|ERROR|passed|failed" $OUT/r/t_gather_planned.txt | tail -4 >> $L
K="python3 benchmarks/backward_kernels.py --impl megamoe --rounds 3 --steady 1 --pass bwd"
for load in "--preset qwen3-30b-a3b --tokens 16384" "--preset qwen3-30b-a3b --tokens 16384 --routing zipf" "--preset deepseek-v3" "--preset deepseek-v3 --routing zipf" "--preset sonic-7b --tokens 24576 --routing zipf"; do
  for s in new:1 base:1 new:0; do
    t=${s%:*}; d=${s#*:}; cd $G/$t
    mkdir -p $OUT/r/$t$d; n=bk_${t}${d}_$(echo $load | tr -d ' -' | cut -c1-40)
    MEGAMOE_WGRAD_PLANNED=$d timeout $(cap 45) $K --out $OUT/r/$t$d $load > $OUT/r/$n.txt 2>&1; say "$n" $?; grep -E "wgrad_ws_kernel|between events" $OUT/r/$n.txt >> $L
  done
done
(cd $OUT && tar czf r.tgz r && rm -rf r)
grep -v "^\s*$" $L | tail -60
