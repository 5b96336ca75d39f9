# call 39 (any Hopper; .gpu/new = git archive HEAD src tests pyproject.toml benchmarks, ab_group_m.py in .gpu/):
# deepseek-v3's BF16 backward at 8192 tokens under zipf with the dx / dact tiles' GROUP_M 8 (the planner's), 16, 32
export MEGAMOE_COMMIT=$(cat $PWD/.gpu/COMMIT 2>/dev/null) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITON_CACHE_DIR=$PWD/.tcache
cd .gpu/new; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 230 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
nvidia-smi --query-gpu=name,power.limit,clocks.sm,memory.total --format=csv,noheader >> $L
for g in 8 16 32 16 8; do
  n=g${g}_$(date +%s)
  AB_GROUP_M=$g timeout $(cap 90) python3 ../ab_group_m.py --impl megamoe --rounds 3 --steady 1 --pass bwd --preset deepseek-v3 --tokens 8192 --routing zipf --out $OUT/r/$n > $OUT/r/$n.txt 2>&1; say $n $?
  grep -E "between events|dx_kernel|dact_ws_kernel" $OUT/r/$n.txt | sed "s/^/g$g /" >> $L
done
(cd $OUT && tar czf r.tgz r && rm -rf r)
grep -v "^\s*$" $L | tail -30
