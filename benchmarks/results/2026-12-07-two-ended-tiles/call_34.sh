# call 34 (the same warm H100 as call 33, the same tree): qwen3-30b-a3b 16384's step under zipf (default plan skew 5)
# and uniform, minutes apart; then the backward's host lead with the host's frames
export MEGAMOE_COMMIT=$(cat $PWD/.gpu/COMMIT 2>/dev/null) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITON_CACHE_DIR=$PWD/.tcache
cd .gpu/new; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 400 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
B="python3 -m megamoe bench --ep 1 --impl megamoe --passes fwd,bwd,step --iters 5 --steady 1 --preset qwen3-30b-a3b --tokens 16384"
for r in zipf uniform; do timeout $(cap 110) $B --routing $r --json $OUT/r/q16_$r.json --md $OUT/r/q16_$r.md > $OUT/r/q16_$r.txt 2>&1; say q16_$r $?; grep -E "^\| megamoe" $OUT/r/q16_$r.md >> $L 2>/dev/null || tail -3 $OUT/r/q16_$r.txt >> $L; done
timeout $(cap 120) python3 benchmarks/backward_kernels.py --impl megamoe --rounds 3 --steady 1 --pass bwd --host --preset qwen3-30b-a3b --tokens 16384 --out $OUT/r/host > $OUT/r/bk_host.txt 2>&1; say bk_host $?; grep -B2 -A16 "ends" $OUT/r/bk_host.txt | head -40 >> $L
(cd $OUT && tar czf r.tgz r && rm -rf r)
grep -v "^\s*$" $L | tail -50
