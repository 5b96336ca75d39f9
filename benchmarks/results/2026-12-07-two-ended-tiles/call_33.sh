# call 33 (.gpu/new = git archive HEAD src tests pyproject.toml benchmarks): the row tiles heaviest expert first and
# dealt from both ends (MEGAMOE_TWO_ENDED_TILES=1) against expert order (0): GPU bits, then the step's expert kernels
# per kernel, interleaved, on the loads where deepseek-v3's dx and dact ran 16-17 % slower under zipf than uniform
export MEGAMOE_COMMIT=$(cat $PWD/.gpu/COMMIT 2>/dev/null) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITON_CACHE_DIR=$PWD/.tcache
cd .gpu/new; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 560 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
nvidia-smi --query-gpu=name,power.limit,clocks.sm,memory.total --format=csv >> $L
timeout $(cap 150) python3 -m pytest -v -m gpu tests/test_two_ended_tiles.py tests/test_experts.py -k "two_ended" --timeout 140 -p no:cacheprovider > $OUT/r/t_bits.txt 2>&1; say t_bits $?; grep -E "FAILED|ERROR|passed|failed" $OUT/r/t_bits.txt | tail -6 >> $L
K="python3 benchmarks/backward_kernels.py --impl megamoe --rounds 3 --steady 1 --pass step"
for s in "deepseek-v3 8192 zipf 0" "deepseek-v3 8192 zipf 1" "deepseek-v3 8192 zipf 0" "deepseek-v3 8192 zipf 1" "deepseek-v3 8192 uniform 1" "deepseek-v3 8192 uniform 0" "qwen3-30b-a3b 16384 zipf 1" "qwen3-30b-a3b 16384 zipf 0"; do
  set -- $s; n=bk_$1_$3_t$4
  MEGAMOE_TWO_ENDED_TILES=$4 timeout $(cap 60) $K --preset $1 --tokens $2 --routing $3 --out $OUT/r/$n > $OUT/r/$n.txt 2>&1; say "$n" $?
  grep -E "between events|(forward_ws|down|dact_ws|dx|wgrad_ws)_kernel$|rows per expert" $OUT/r/$n.txt | sed 's/megamoe.s CUDA.*//' | cut -c1-150 >> $L
done
(cd $OUT && tar czf r.tgz r && rm -rf r)
grep -v "^\s*$" $L | tail -60
