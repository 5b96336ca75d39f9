# H200: the GPU soak, kimi-k2 at EP 1 (BF16 and FP8-block against nccl-torch), then the layer's GPU gradient test
export PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd .gpu; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( ${LIMIT:-420} - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
nvidia-smi --query-gpu=name,power.limit,clocks.sm,memory.total --format=csv >> $L
MEGAMOE_SOAK_GPU_PASSES=100 timeout $(cap 70) python3 -m pytest -q -m gpu -x -p no:cacheprovider tests/test_soak.py > $OUT/r/soak.txt 2>&1; say soak $?; tail -2 $OUT/r/soak.txt >> $L
big=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "$big" -gt 100000 ]; then
timeout $(cap 300) python3 -m megamoe bench --ep 1 --impl nccl-torch,megamoe --experts bf16,fp8-block --preset kimi-k2 --tokens 8192 --passes fwd,bwd,step --iters 5 --steady 1 --json $OUT/r/kimi.json --md $OUT/r/kimi.md > $OUT/r/kimi.txt 2>&1; say kimi $?; grep -E "^\| (megamoe|nccl)" $OUT/r/kimi.md >> $L || tail -8 $OUT/r/kimi.txt >> $L
fi
timeout $(cap 400) python3 -m pytest -q -s -m gpu -x -p no:cacheprovider tests/test_training.py -k gpu_gradients > $OUT/r/grad.txt 2>&1; say gpu_gradients $?; grep -E "rank .* in |passed|failed" $OUT/r/grad.txt | tail -8 >> $L
grep -v "^\s*$" $L | tail -40
