# call 17: the BF16 Gluon dact in 128 x 256 tiles (MEGAMOE_DACT_WIDE=1: two 128-wide epilogues a tile, the same router partials) against 128 x 128 (0): GPU bits (both widths, every activation), then backward_kernels.py at deepseek-v3 8192 and qwen3-30b-a3b 16384, each setting in its own process
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd .gpu; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 240 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
nvidia-smi --query-gpu=name,power.limit,clocks.sm,memory.total --format=csv >> $L
timeout $(cap 70) python3 -m pytest -v -m gpu tests/test_experts.py -k "dact_ws" -p no:cacheprovider > $OUT/r/t_dact.txt 2>&1; say t_dact $?; grep -E "FAILED|ERROR|passed|failed" $OUT/r/t_dact.txt | tail -6 >> $L
K="python3 benchmarks/backward_kernels.py --impl megamoe --rounds 3 --steady 1 --pass bwd"
for run in "1 --preset deepseek-v3" "0 --preset deepseek-v3" "1 --preset qwen3-30b-a3b --tokens 16384" "0 --preset qwen3-30b-a3b --tokens 16384"; do
  w=${run%% *}; load=${run#* }
  mkdir -p $OUT/r/w$w; n=bk_w${w}_$(echo $load | tr -d ' -' | cut -c1-40)
  MEGAMOE_DACT_WIDE=$w timeout $(cap 45) $K --out $OUT/r/w$w $load > $OUT/r/$n.txt 2>&1; say "$n" $?; grep -E "dact_ws_kernel|between events" $OUT/r/$n.txt >> $L
done
(cd $OUT && tar czf r.tgz r && rm -rf r)
grep -v "^\s*$" $L | tail -30
