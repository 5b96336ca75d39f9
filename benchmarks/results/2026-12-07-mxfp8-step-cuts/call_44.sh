# call 44 (.gpu/new = 3ac4ea3: d_h on the MXFP8 grid in the dact epilogue, one rank's x and d_out staged BF16 and
# rounded in the device work): the Gluon dact's grid store against the rounding pass and the BF16 dact's bits (GPU
# tests), qwen3-30b-a3b's mxfp8 step beside BF16, and the host's side of the mxfp8 step (backward_kernels --host);
# call 43's content cut to the session's remaining device time
export MEGAMOE_COMMIT=$(cat $PWD/.gpu/COMMIT 2>/dev/null) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITON_CACHE_DIR=$PWD/.tcache
cd .gpu/new; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 330 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
nvidia-smi --query-gpu=name,power.limit,clocks.sm,memory.total --format=csv >> $L
timeout $(cap 120) python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_experts_mxfp8_bf16.py tests/test_experts.py -k "gluon_dact or dact_ws" > $OUT/r/tests.txt 2>&1; say tests $?; tail -3 $OUT/r/tests.txt >> $L
B="python3 -m megamoe bench --ep 1 --passes fwd,bwd,step --iters 5 --steady 1 --preset qwen3-30b-a3b --tokens 8192 --impl megamoe"
timeout $(cap 80) $B --experts mxfp8,bf16 --json $OUT/r/q8_mx.json --md $OUT/r/q8_mx.md > $OUT/r/q8_mx.txt 2>&1; say q8_mx $?; grep -E "^\| megamoe" $OUT/r/q8_mx.md >> $L
timeout $(cap 100) python3 benchmarks/backward_kernels.py --impl megamoe --out $OUT/r --rounds 3 --steady 1 --preset qwen3-30b-a3b --pass step --host --experts mxfp8 > $OUT/r/host_mxfp8.txt 2>&1; say host_mxfp8 $?; grep -v Warn $OUT/r/host_mxfp8.txt | tail -40 >> $L
(cd $OUT && tar czf r.tgz r && rm -rf r)
cat $L
