# call 37 (any Hopper; .gpu/new = git archive HEAD src tests pyproject.toml benchmarks, gpu_probe.py in .gpu/probe/):
# the kept E4M3 ring NaN-poisoned against zero-filled, the same bits? (fp8-block and mxfp8, 1 and 2 ranks)
export MEGAMOE_COMMIT=$(cat $PWD/.gpu/COMMIT 2>/dev/null) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=src:$PWD/.gpu/probe PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITON_CACHE_DIR=$PWD/.tcache
cd .gpu/new; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 560 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
nvidia-smi --query-gpu=name,power.limit,clocks.sm,memory.total --format=csv >> $L
timeout $(cap 400) python3 ../probe/gpu_probe.py > $OUT/r/probe.txt 2>&1; say probe $?
grep -E "DIFFERS|VERDICT|Error" $OUT/r/probe.txt | head -20 >> $L; grep -c "^same" $OUT/r/probe.txt >> $L
(cd $OUT && tar czf r.tgz r && rm -rf r)
grep -v "^\s*$" $L | tail -40
