# call 48: per kernel, qwen3-30b-a3b's mxfp8 step with the Gluon dact's grid store (MEGAMOE_GLUON_D_H_GRID=1) and
# without (the rounding pass): where call 47's +0.4-0.5 ms goes; then qwen3-30b-a3b's fp8-block step beside BF16
export MEGAMOE_COMMIT=$(cat $PWD/.gpu/COMMIT 2>/dev/null) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITON_CACHE_DIR=$PWD/.tcache
cd .gpu/new; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 300 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
K="python3 benchmarks/backward_kernels.py --impl megamoe --rounds 3 --steady 1 --preset qwen3-30b-a3b --pass step --experts mxfp8"
for g in 1 0; do mkdir -p $OUT/r/g$g
  MEGAMOE_GLUON_D_H_GRID=$g timeout $(cap 80) $K --out $OUT/r/g$g > $OUT/r/k_grid$g.txt 2>&1; say k_grid$g $?; grep -v Warn $OUT/r/k_grid$g.txt | grep -E "between events|dact|dx_kernel|quantize|elementwise|x[0-9]+ +mx" >> $L
done
B="python3 -m megamoe bench --ep 1 --passes fwd,bwd,step --iters 5 --steady 1 --preset qwen3-30b-a3b --tokens 8192 --impl megamoe --experts fp8-block,bf16"
timeout $(cap 80) $B --json $OUT/r/q8_fp8.json --md $OUT/r/q8_fp8.md > $OUT/r/q8_fp8.txt 2>&1; say q8_fp8 $?; grep -E "^\| megamoe" $OUT/r/q8_fp8.md >> $L
(cd $OUT && tar czf r.tgz r && rm -rf r)
cat $L
