# call 11: the dynamic wgrad deal taking its next block before the current one's last STAGES loads (a relaxed lane add read after them; the take's coordinates from the deal): the GPU bit tests, then static (d0) against dynamic (d1), each setting in its own process, uniform first (the fixed cost a block), then zipf (the gain)
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd .gpu; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 400 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
nvidia-smi --query-gpu=name,power.limit,clocks.sm,memory.total --format=csv >> $L
timeout $(cap 70) python3 -m pytest -v -m gpu tests/test_experts.py -k "wgrad_ws" -p no:cacheprovider > $OUT/r/t_wgrad.txt 2>&1; say t_wgrad $?; grep -E "FAILED|ERROR|passed|failed" $OUT/r/t_wgrad.txt | tail -8 >> $L
K="python3 benchmarks/backward_kernels.py --impl megamoe --rounds 3 --steady 1 --pass bwd"
for dargs in "0 --preset qwen3-30b-a3b --tokens 16384" "1 --preset qwen3-30b-a3b --tokens 16384" "0 --preset deepseek-v3" "1 --preset deepseek-v3" "0 --preset qwen3-30b-a3b --tokens 16384 --routing zipf" "1 --preset qwen3-30b-a3b --tokens 16384 --routing zipf" "0 --preset deepseek-v3 --routing zipf" "1 --preset deepseek-v3 --routing zipf"; do
  d=${dargs%% *}; args=${dargs#* }
  mkdir -p $OUT/r/d$d; n=bk_d${d}_$(echo $args | tr -d ' -' | cut -c1-40)
  MEGAMOE_WGRAD_DYNAMIC=$d timeout $(cap 60) $K --out $OUT/r/d$d $args > $OUT/r/$n.txt 2>&1; say "$n" $?; grep -E "wgrad_ws_kernel|between events" $OUT/r/$n.txt >> $L
done
(cd $OUT && tar czf r.tgz r && rm -rf r)
grep -v "^\s*$" $L | tail -60
