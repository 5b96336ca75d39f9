# call 41: qwen3-30b-a3b's mxfp8 step beside BF16 twice more (the spread of call 40's 0.887x)
export MEGAMOE_COMMIT=$(cat $PWD/.gpu/COMMIT 2>/dev/null) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITON_CACHE_DIR=$PWD/.tcache
cd .gpu/new; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
B="python3 -m megamoe bench --ep 1 --passes fwd,bwd,step --iters 5 --steady 1 --preset qwen3-30b-a3b --tokens 8192 --impl megamoe"
for i in 1 2; do timeout 150 $B --experts mxfp8,bf16 --json $OUT/r/q8_mx_$i.json --md $OUT/r/q8_mx_$i.md > $OUT/r/q8_mx_$i.txt 2>&1; echo "== q8_mx_$i rc=$? t=$(( $(date +%s)-t0 ))" >> $L; grep -E "^\| megamoe" $OUT/r/q8_mx_$i.md >> $L; done
(cd $OUT && tar czf r.tgz r && rm -rf r)
cat $L
