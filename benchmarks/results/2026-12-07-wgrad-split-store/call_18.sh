# call 18: the 256-wide dact (MEGAMOE_DACT_WIDE) and the split store (MEGAMOE_WGRAD_SPLIT_STORE) at more shapes, to see where the wide dact pays (call 17: deepseek-v3 D 7168 -6 %, qwen3-30b-a3b D 2048 +15 %): sonic-120b (D 4096), gpt-oss-120b (D 2880), qwen3-235b-a22b (D 4096, I 1536), deepseek-v3 and qwen3-30b-a3b again, each setting in its own process, settings alternated
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd .gpu; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 420 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
nvidia-smi --query-gpu=name,power.limit,clocks.sm,memory.total --format=csv >> $L
K="python3 benchmarks/backward_kernels.py --impl megamoe --rounds 3 --steady 1 --pass bwd"
for load in "--preset sonic-120b --tokens 16384" "--preset qwen3-235b-a22b --tokens 8192" "--preset gpt-oss-120b --tokens 8192" "--preset qwen3-30b-a3b --tokens 8192" "--preset deepseek-v3"; do
  for w in 1 0; do
    mkdir -p $OUT/r/w$w; n=bk_w${w}_$(echo $load | tr -d ' -' | cut -c1-40)
    MEGAMOE_DACT_WIDE=$w MEGAMOE_WGRAD_SPLIT_STORE=$w timeout $(cap 45) $K --out $OUT/r/w$w $load > $OUT/r/$n.txt 2>&1; say "$n" $?; grep -E "dact_ws_kernel|wgrad_ws_kernel|between events" $OUT/r/$n.txt >> $L
  done
done
(cd $OUT && tar czf r.tgz r && rm -rf r)
grep -v "^\s*$" $L | tail -40
