# call 20: the planned wgrad deal (MEGAMOE_WGRAD_PLANNED: the counter deal's order in a fixed plan, heavy and light blocks in turn a program, no atomics) against the static deal: GPU bits (every Gluon wgrad variant), then the backward per kernel under uniform and zipf routing, each setting in its own process, settings alternated
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd .gpu; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 500 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
nvidia-smi --query-gpu=name,power.limit,clocks.sm,memory.total --format=csv >> $L
timeout $(cap 90) python3 -m pytest -v -m gpu tests/test_experts.py -k "wgrad_ws" -p no:cacheprovider > $OUT/r/t_wgrad.txt 2>&1; say t_wgrad $?; grep -E "FAILED|ERROR|passed|failed" $OUT/r/t_wgrad.txt | tail -6 >> $L
MEGAMOE_WGRAD_PLANNED=1 timeout $(cap 50) python3 -m pytest -v -m gpu tests/test_experts.py -k "gathered_operands" -p no:cacheprovider > $OUT/r/t_gather_planned.txt 2>&1; say t_gather_planned $?; grep -E "FAILED|ERROR|passed|failed" $OUT/r/t_gather_planned.txt | tail -4 >> $L
K="python3 benchmarks/backward_kernels.py --impl megamoe --rounds 3 --steady 1 --pass bwd"
for load in "--preset qwen3-30b-a3b --tokens 16384 --routing zipf" "--preset qwen3-30b-a3b --tokens 16384" "--preset deepseek-v3 --routing zipf" "--preset deepseek-v3" "--preset sonic-7b --tokens 24576 --routing zipf"; do
  for d in 1 0; do
    mkdir -p $OUT/r/p$d; n=bk_p${d}_$(echo $load | tr -d ' -' | cut -c1-40)
    MEGAMOE_WGRAD_PLANNED=$d timeout $(cap 45) $K --out $OUT/r/p$d $load > $OUT/r/$n.txt 2>&1; say "$n" $?; grep -E "wgrad_ws_kernel|between events" $OUT/r/$n.txt >> $L
  done
done
(cd $OUT && tar czf r.tgz r && rm -rf r)
grep -v "^\s*$" $L | tail -40
