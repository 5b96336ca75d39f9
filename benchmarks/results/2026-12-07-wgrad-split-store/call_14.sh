# call 14: the Gluon wgrad storing each half block in 64-column quarters through two 64 x 64 buffers a consumer, its ring deeper by the shared memory that frees (8 slots instead of 6 at BK 32, 4 instead of 3 at the gathering BK 64): MEGAMOE_WGRAD_SPLIT_STORE=0/1, GPU bits first, then each setting in its own process
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd .gpu; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( ${CAP:-200} - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
nvidia-smi --query-gpu=name,power.limit,clocks.sm,memory.total --format=csv >> $L
MEGAMOE_WGRAD_SPLIT_STORE=1 timeout $(cap 60) python3 -m pytest -v -m gpu tests/test_experts.py -k "wgrad_ws" -p no:cacheprovider > $OUT/r/t_wgrad.txt 2>&1; say t_wgrad_split $?; grep -E "FAILED|ERROR|passed|failed" $OUT/r/t_wgrad.txt | tail -6 >> $L
K="python3 benchmarks/backward_kernels.py --impl megamoe --rounds 3 --steady 1 --pass bwd"
for run in "1 --preset deepseek-v3" "0 --preset deepseek-v3" "1 --preset qwen3-30b-a3b --tokens 16384" "0 --preset qwen3-30b-a3b --tokens 16384"; do
  s=${run%% *}; load=${run#* }
  mkdir -p $OUT/r/s$s; n=bk_s${s}_$(echo $load | tr -d ' -' | cut -c1-40)
  MEGAMOE_WGRAD_SPLIT_STORE=$s timeout $(cap 45) $K --out $OUT/r/s$s $load > $OUT/r/$n.txt 2>&1; say "$n" $?; grep -E "wgrad_ws_kernel|between events" $OUT/r/$n.txt >> $L
done
for s in 1 0; do
  n=gvd_dsv3_s$s; (cd benchmarks && MEGAMOE_WGRAD_SPLIT_STORE=$s PYTHONPATH=../src timeout $(cap 50) python3 gemm_vs_dense.py --preset deepseek-v3 --tokens 8192 --experts 256 --rounds 2 --seconds 0.3 --out $OUT/r/$n > $OUT/r/$n.txt 2>&1); say $n $?; grep -E "backward" $OUT/r/$n.txt | head -4 | cut -c1-300 >> $L
done
(cd $OUT && tar czf r.tgz r && rm -rf r)
grep -v "^\s*$" $L | tail -40
