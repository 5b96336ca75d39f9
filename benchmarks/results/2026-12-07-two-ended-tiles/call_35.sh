# call 35 (the same warm H100, the same tree): deepseek-v3 8192 step under zipf (default plan skew) and uniform
# and uniform, minutes apart; then the backward's host lead with the host's frames
export MEGAMOE_COMMIT=$(cat $PWD/.gpu/COMMIT 2>/dev/null) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITON_CACHE_DIR=$PWD/.tcache
cd .gpu/new; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 400 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
B="python3 -m megamoe bench --ep 1 --impl megamoe --passes fwd,bwd,step --iters 5 --steady 1 --preset deepseek-v3 --tokens 8192"
for r in zipf uniform; do timeout $(cap 130) $B --routing $r --json $OUT/r/d8_$r.json --md $OUT/r/d8_$r.md > $OUT/r/d8_$r.txt 2>&1; say d8_$r $?; grep -E "^\| megamoe" $OUT/r/d8_$r.md >> $L 2>/dev/null || tail -3 $OUT/r/d8_$r.txt >> $L; done
(cd $OUT && tar czf r.tgz r && rm -rf r)
grep -v "^\s*$" $L | tail -50
