# call 46 (call 45 with a 150 s budget) (.gpu/new = the tree with the Gluon dact's grid store behind MEGAMOE_GLUON_D_H_GRID, off by default): its
# GPU test (forced on) and the BF16 dact's bits, then qwen3-30b-a3b's mxfp8 step beside BF16 with the switch on;
# cut to the session's last device minutes
export MEGAMOE_COMMIT=$(cat $PWD/.gpu/COMMIT 2>/dev/null) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITON_CACHE_DIR=$PWD/.tcache
cd .gpu/new; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 150 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
nvidia-smi --query-gpu=name,power.limit,clocks.sm,memory.total --format=csv >> $L
timeout $(cap 110) python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_experts_mxfp8_bf16.py tests/test_experts.py -k "gluon_dact or dact_ws" > $OUT/r/tests.txt 2>&1; say tests $?; tail -3 $OUT/r/tests.txt >> $L
MEGAMOE_GLUON_D_H_GRID=1 timeout $(cap 80) python3 -m megamoe bench --ep 1 --passes fwd,bwd,step --iters 5 --steady 1 --preset qwen3-30b-a3b --tokens 8192 --impl megamoe --experts mxfp8,bf16 --json $OUT/r/q8_mx.json --md $OUT/r/q8_mx.md > $OUT/r/q8_mx.txt 2>&1; say q8_mx $?; grep -E "^\| megamoe" $OUT/r/q8_mx.md >> $L
(cd $OUT && tar czf r.tgz r && rm -rf r)
cat $L
