# call 9: two wgrad levers against the static deal, each setting in its own process (MEGAMOE_WGRAD_STAGGER=s, MEGAMOE_WGRAD_DYNAMIC=d): the consumers staggered (the second warpgroup half a ring behind the first, so the two halves' stores do not idle the tensor cores at once), and the dynamic deal with its next take held a block ahead; first the GPU bit tests (both levers), then the backward per kernel, uniform first
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd .gpu; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 250 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
nvidia-smi --query-gpu=name,power.limit,clocks.sm,memory.total --format=csv >> $L
timeout $(cap 70) python3 -m pytest -v -m gpu tests/test_experts.py -k "wgrad_ws" -p no:cacheprovider > $OUT/r/t_wgrad.txt 2>&1; say t_wgrad $?; grep -E "FAILED|ERROR|passed|failed" $OUT/r/t_wgrad.txt | tail -8 >> $L
K="python3 benchmarks/backward_kernels.py --impl megamoe --rounds 3 --steady 1 --pass bwd"
for sdargs in "0 0 --preset deepseek-v3" "1 0 --preset deepseek-v3" "0 0 --preset qwen3-30b-a3b --tokens 16384" "1 0 --preset qwen3-30b-a3b --tokens 16384" "0 1 --preset deepseek-v3" "0 1 --preset qwen3-30b-a3b --tokens 16384" "0 1 --preset qwen3-30b-a3b --tokens 16384 --routing zipf" "1 1 --preset deepseek-v3"; do
  s=${sdargs%% *}; rest=${sdargs#* }; d=${rest%% *}; args=${rest#* }
  o=s${s}d$d; mkdir -p $OUT/r/$o; n=bk_${o}_$(echo $args | tr -d ' -' | cut -c1-40)
  MEGAMOE_WGRAD_STAGGER=$s MEGAMOE_WGRAD_DYNAMIC=$d timeout $(cap 45) $K --out $OUT/r/$o $args > $OUT/r/$n.txt 2>&1; say "$n" $?; grep -E "wgrad_ws_kernel|between events" $OUT/r/$n.txt >> $L
done
(cd $OUT && tar czf r.tgz r && rm -rf r)
grep -v "^\s*$" $L | tail -60
