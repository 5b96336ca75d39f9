# C4 (5578666, H100): the GPU tests (backward ring, training, FP8 backward), qwen3-30b-a3b fp8-block with MEGAMOE_FP8_BF16_WGRADS=0/1
export PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd .gpu; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 470 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
nvidia-smi --query-gpu=name,power.limit,clocks.sm,memory.total --format=csv >> $L
B="python3 -m megamoe bench --ep 1 --impl megamoe --tokens 8192 --passes fwd,bwd,step --iters 5 --steady 1"
for w in 0 1; do
MEGAMOE_FP8_BF16_WGRADS=$w timeout $(cap 75) $B --experts bf16,fp8-block --preset qwen3-30b-a3b --json $OUT/r/qfp8_w$w.json --md $OUT/r/qfp8_w$w.md > $OUT/r/qfp8_w$w.txt 2>&1; say "qwen3 fp8-block bf16_wgrads=$w" $?; grep -E "^\| (megamoe|nccl)" $OUT/r/qfp8_w$w.md >> $L || tail -3 $OUT/r/qfp8_w$w.txt >> $L
done
timeout $(cap 330) python3 -m pytest -v -m gpu tests/test_backward_ring.py tests/test_training.py tests/test_experts_fp8_bwd.py -k "gpu and not knobs" -p no:cacheprovider --durations=0 > $OUT/r/gpu_tests.txt 2>&1; say gpu_tests $?; grep -E "PASSED|FAILED|ERROR|passed|failed" $OUT/r/gpu_tests.txt | tail -30 >> $L
(cd $OUT && tar czf r.tgz r && rm -rf r)
grep -v "^\s*$" $L | tail -60
