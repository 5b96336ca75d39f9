# call 13 (src_nostore: src with no_store.patch applied): (1) the static wgrad deal's expert walk in phases (MEGAMOE_WGRAD_PHASES=1/2: programs in interleaved groups, each group's walk starting at its share of the experts, so light experts' write-bound blocks run beside heavy ones' compute-bound blocks) and two output buffers a consumer (MEGAMOE_WGRAD_OUT_BUFFERS=2): GPU bit tests, then backward_kernels.py each setting in its own process; (2) diagnostic at deepseek-v3's 256 rows an expert: gemm_vs_dense's expert backward by kernel with the wgrad's stores skipped, and with two output buffers
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd .gpu; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 380 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
nvidia-smi --query-gpu=name,power.limit,clocks.sm,memory.total --format=csv >> $L
MEGAMOE_WGRAD_PHASES=2 MEGAMOE_WGRAD_OUT_BUFFERS=2 timeout $(cap 60) python3 -m pytest -v -m gpu tests/test_experts.py -k "wgrad_ws_gives" -p no:cacheprovider > $OUT/r/t_wgrad.txt 2>&1; say t_wgrad_p2_b2 $?; grep -E "FAILED|ERROR|passed|failed" $OUT/r/t_wgrad.txt | tail -6 >> $L
K="python3 benchmarks/backward_kernels.py --impl megamoe --rounds 3 --steady 1 --pass bwd"
for run in "1 --preset deepseek-v3 --routing zipf" "2 --preset deepseek-v3 --routing zipf" "1 --preset qwen3-30b-a3b --tokens 16384 --routing zipf" "2 --preset qwen3-30b-a3b --tokens 16384 --routing zipf" "1 --preset deepseek-v3" "2 --preset deepseek-v3" "1 --preset qwen3-30b-a3b --tokens 16384" "2 --preset qwen3-30b-a3b --tokens 16384"; do
  p=${run%% *}; load=${run#* }
  mkdir -p $OUT/r/p$p; n=bk_p${p}_$(echo $load | tr -d ' -' | cut -c1-40)
  MEGAMOE_WGRAD_PHASES=$p timeout $(cap 45) $K --out $OUT/r/p$p $load > $OUT/r/$n.txt 2>&1; say "$n" $?; grep -E "wgrad_ws_kernel|between events" $OUT/r/$n.txt >> $L
done
for v in "src 1" "src_nostore 1" "src 2"; do
  set -- $v; n=gvd_dsv3_$1_b$2
  (cd benchmarks && MEGAMOE_WGRAD_OUT_BUFFERS=$2 PYTHONPATH=../$1 timeout $(cap 60) python3 gemm_vs_dense.py --preset deepseek-v3 --tokens 8192 --experts 256 --rounds 2 --seconds 0.3 --out $OUT/r/$n > $OUT/r/$n.txt 2>&1); say $n $?; grep -E "backward" $OUT/r/$n.txt | head -4 | cut -c1-300 >> $L
done
(cd $OUT && tar czf r.tgz r && rm -rf r)
grep -v "^\s*$" $L | tail -70
