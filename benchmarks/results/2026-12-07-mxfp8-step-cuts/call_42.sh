# call 42: the host's side of qwen3-30b-a3b's mxfp8 and BF16 steps (backward_kernels --host: the host operators and
# Python frames before the first launch, which call 40's profile put 1478 us (mxfp8) against 922 us (BF16))
export MEGAMOE_COMMIT=$(cat $PWD/.gpu/COMMIT 2>/dev/null) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITON_CACHE_DIR=$PWD/.tcache
cd .gpu/new; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
K="python3 benchmarks/backward_kernels.py --impl megamoe --out $OUT/r --rounds 3 --steady 1 --preset qwen3-30b-a3b --pass step --host"
for e in mxfp8 bf16; do timeout 200 $K --experts $e > $OUT/r/host_$e.txt 2>&1; echo "== host_$e rc=$? t=$(( $(date +%s)-t0 ))" >> $L; grep -v Warn $OUT/r/host_$e.txt | tail -45 >> $L; done
(cd $OUT && tar czf r.tgz r && rm -rf r)
cat $L
