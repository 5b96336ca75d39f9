# C3 (5578666): GPU tests (backward ring, training), GPU soak (48 passes), kimi-k2 BF16 backward per kernel
export PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd .gpu; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 570 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
nvidia-smi --query-gpu=name,power.limit,clocks.sm,memory.total --format=csv >> $L
timeout $(cap 200) python3 -m pytest -q -m gpu tests/test_backward_ring.py tests/test_training.py tests/test_experts_fp8_bwd.py -k "gpu and not knobs" -p no:cacheprovider > $OUT/r/gpu_tests.txt 2>&1; say gpu_tests $?; tail -4 $OUT/r/gpu_tests.txt >> $L
MEGAMOE_SOAK_GPU_PASSES=48 timeout $(cap 120) python3 -m pytest -q -m gpu tests/test_soak.py -k gpu -p no:cacheprovider > $OUT/r/soak.txt 2>&1; say soak $?; tail -3 $OUT/r/soak.txt >> $L
timeout $(cap 200) python3 benchmarks/backward_kernels.py --preset deepseek-v3 --pass bwd --tokens 8192 --out $OUT/r/bk_dsv3.json > $OUT/r/bk_dsv3.txt 2>&1; say bk_dsv3 $?; tail -40 $OUT/r/bk_dsv3.txt >> $L
(cd $OUT && tar czf r.tgz r && rm -rf r)
grep -v "^\s*$" $L | tail -80
