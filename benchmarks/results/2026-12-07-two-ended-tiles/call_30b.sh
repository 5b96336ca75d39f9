# call 30 (next GPU session; .gpu/new = git archive HEAD src tests pyproject.toml benchmarks, planned_early_exit.patch
# copied to .gpu/): the plan's launch as a no-op on even loads cost ~11 us a wgrad (call 27: qwen3-30b-a3b uniform
# 2.350 ms with both launches against 2.327 with the static deal's alone) - its producer makes its two descriptor
# sites before finding no block. The patch skips its partitions where the deal counted no block (sm_90: 168
# registers, no stack, as before). GPU bits of the patched tree (every plan skew), then the wgrads A/B, interleaved.
export MEGAMOE_COMMIT=$(cat $PWD/.gpu/COMMIT 2>/dev/null) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
G=$PWD/.gpu; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 380 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
nvidia-smi --query-gpu=name,power.limit,clocks.sm,memory.total --format=csv >> $L
rm -rf $G/early && cp -r $G/new $G/early && (cd $G/early && patch -p1 < $G/planned_early_exit.patch) >> $L 2>&1
cd $G/early
timeout $(cap 170) python3 -m pytest -v -m gpu tests/test_experts.py -k "wgrad_ws" --timeout 160 -p no:cacheprovider > $OUT/r/t_early.txt 2>&1; say t_early $?; grep -E "FAILED|ERROR|passed|failed" $OUT/r/t_early.txt | tail -6 >> $L
K="python3 benchmarks/backward_kernels.py --impl megamoe --rounds 3 --steady 1 --pass bwd"
for load in "--preset qwen3-30b-a3b --tokens 16384"; do
  for s in early:5 new:5 early:5 new:5; do
    IFS=: read t k <<< "$s"; cd $G/$t
    n=bk_${t}_s${k}_$(echo $load | tr -d ' -' | cut -c1-40)
    MEGAMOE_WGRAD_PLAN_SKEW=$k timeout $(cap 40) $K --out /tmp/o_$t $load > $OUT/r/$n.txt 2>&1; say "$n" $?; grep -E "wgrad_ws_kernel" $OUT/r/$n.txt >> $L
  done
done
(cd $OUT && tar czf r.tgz r && rm -rf r)
grep -v "^\s*$" $L | tail -40
