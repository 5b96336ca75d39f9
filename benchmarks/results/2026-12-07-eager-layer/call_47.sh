# call 47: the Gluon dact storing dx's d_h on the MXFP8 grid (MEGAMOE_GLUON_D_H_GRID=1) against the rounding pass
# (=0): qwen3-30b-a3b's mxfp8 step beside BF16, alternating, three runs each
export MEGAMOE_COMMIT=$(cat $PWD/.gpu/COMMIT 2>/dev/null) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITON_CACHE_DIR=$PWD/.tcache
cd .gpu/new; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 400 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
nvidia-smi --query-gpu=name,power.limit,clocks.sm,memory.total --format=csv >> $L
B="python3 -m megamoe bench --ep 1 --passes step --iters 5 --steady 1 --preset qwen3-30b-a3b --tokens 8192 --impl megamoe --experts mxfp8,bf16"
for i in 1 2 3; do for g in 1 0; do n=grid${g}_$i
  MEGAMOE_GLUON_D_H_GRID=$g timeout $(cap 60) $B --json $OUT/r/$n.json --md $OUT/r/$n.md > $OUT/r/$n.txt 2>&1; say $n $?; grep -E "^\| megamoe" $OUT/r/$n.md >> $L
done; done
(cd $OUT && tar czf r.tgz r && rm -rf r)
cat $L
