# call 13 (with src_nostore: .gpu/src with no_store.patch applied): the static wgrad deal's expert walk in phases (MEGAMOE_WGRAD_PHASES=1/2/4: programs in interleaved groups, each group's walk starting at its share of the experts, so light experts' write-bound blocks run beside heavy ones' compute-bound blocks): GPU bit tests at 2 and 4, then each setting in its own process, uniform and zipf, qwen3-30b-a3b 16384 and deepseek-v3
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd .gpu; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 570 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
nvidia-smi --query-gpu=name,power.limit,clocks.sm,memory.total --format=csv >> $L
for p in 2 4; do
  MEGAMOE_WGRAD_PHASES=$p timeout $(cap 60) python3 -m pytest -v -m gpu tests/test_experts.py -k "wgrad_ws and not dynamic" -p no:cacheprovider > $OUT/r/t_wgrad_p$p.txt 2>&1; say t_wgrad_p$p $?; grep -E "FAILED|ERROR|passed|failed" $OUT/r/t_wgrad_p$p.txt | tail -6 >> $L
done
K="python3 benchmarks/backward_kernels.py --impl megamoe --rounds 3 --steady 1 --pass bwd"
for load in "--preset deepseek-v3 --routing zipf" "--preset qwen3-30b-a3b --tokens 16384 --routing zipf" "--preset deepseek-v3" "--preset qwen3-30b-a3b --tokens 16384"; do
  for p in 1 2 4; do
    mkdir -p $OUT/r/p$p; n=bk_p${p}_$(echo $load | tr -d ' -' | cut -c1-40)
    MEGAMOE_WGRAD_PHASES=$p timeout $(cap 50) $K --out $OUT/r/p$p $load > $OUT/r/$n.txt 2>&1; say "$n" $?; grep -E "wgrad_ws_kernel|between events" $OUT/r/$n.txt >> $L
  done
done
# diagnostic: the static wgrad with its stores skipped (no_store.patch applied to a copy of src: src_nostore), against the stored one, gemm_vs_dense's expert backward split by kernel
for load in "deepseek-v3 8192 256" "qwen3-30b-a3b 16384 128"; do
  set -- $load
  for src in src src_nostore; do
    n=gvd_$1_$src; (cd benchmarks && PYTHONPATH=../$src timeout $(cap 60) python3 gemm_vs_dense.py --preset $1 --tokens $2 --experts $3 --rounds 2 --seconds 0.3 --out $OUT/r/$n > $OUT/r/$n.txt 2>&1); say $n $?; grep -E "wgrad" $OUT/r/$n.txt | head -4 >> $L
  done
done
(cd $OUT && tar czf r.tgz r && rm -rf r)
grep -v "^\s*$" $L | tail -70
