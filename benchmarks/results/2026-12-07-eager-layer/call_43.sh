# call 43 (.gpu/new = the tree with d_h rounded to the MXFP8 grid in the dact epilogue): its GPU tests (the Gluon
# dact's grid store against the rounding pass, the BF16 dact's bits), qwen3-30b-a3b's mxfp8 step beside BF16, and
# the host's side of both steps (backward_kernels --host)
export MEGAMOE_COMMIT=$(cat $PWD/.gpu/COMMIT 2>/dev/null) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITON_CACHE_DIR=$PWD/.tcache
cd .gpu/new; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 560 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
nvidia-smi --query-gpu=name,power.limit,clocks.sm,memory.total --format=csv >> $L
timeout $(cap 150) python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_experts_mxfp8_bf16.py tests/test_experts.py -k "gluon_dact or dact_ws" > $OUT/r/tests.txt 2>&1; say tests $?; tail -3 $OUT/r/tests.txt >> $L
B="python3 -m megamoe bench --ep 1 --passes fwd,bwd,step --iters 5 --steady 1 --preset qwen3-30b-a3b --tokens 8192 --impl megamoe"
for i in 1 2; do timeout $(cap 80) $B --experts mxfp8,bf16 --json $OUT/r/q8_mx_$i.json --md $OUT/r/q8_mx_$i.md > $OUT/r/q8_mx_$i.txt 2>&1; say q8_mx_$i $?; grep -E "^\| megamoe" $OUT/r/q8_mx_$i.md >> $L; done
K="python3 benchmarks/backward_kernels.py --impl megamoe --out $OUT/r --rounds 3 --steady 1 --preset qwen3-30b-a3b --pass step --host"
for e in mxfp8 bf16; do timeout $(cap 100) $K --experts $e > $OUT/r/host_$e.txt 2>&1; say host_$e $?; grep -v Warn $OUT/r/host_$e.txt | tail -40 >> $L; done
(cd $OUT && tar czf r.tgz r && rm -rf r)
cat $L
