# the composed backward's windows from a CUDA graph: the bits (GPU tests), then the step (H200: kimi-k2 too)
export PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd .gpu; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 560 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
nvidia-smi --query-gpu=name,power.limit,clocks.sm,memory.total --format=csv >> $L
big=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
timeout $(cap 150) python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_backward_ring.py > $OUT/r/t1.txt 2>&1; say backward_ring $?; tail -4 $OUT/r/t1.txt >> $L
for p in qwen3-30b-a3b:8192 sonic-7b:24576; do
timeout $(cap 60) python3 benchmarks/backward_kernels.py --preset ${p%%:*} --tokens ${p##*:} --impl megamoe --pass step --steady 3 --rounds 3 --out $OUT/r/s > $OUT/r/s_${p%%:*}.txt 2>&1; say "step $p" $?; grep -E "ms between|graphs after|gaps between" $OUT/r/s_${p%%:*}.txt >> $L
done
timeout $(cap 120) python3 -m megamoe bench --ep 1 --impl nccl-torch,megamoe --preset qwen3-30b-a3b --tokens 8192 --passes fwd,bwd,step --iters 10 --json $OUT/r/q8.json --md $OUT/r/q8.md > $OUT/r/q8.txt 2>&1; say q8 $?; grep -E "^\| (megamoe|nccl)" $OUT/r/q8.md >> $L
if [ "$big" -gt 100000 ]; then
timeout $(cap 400) python3 -m megamoe bench --ep 1 --impl nccl-torch,megamoe --experts bf16,fp8-block --preset kimi-k2 --tokens 8192 --passes fwd,bwd,step --iters 5 --steady 1 --json $OUT/r/k8.json --md $OUT/r/k8.md > $OUT/r/k8.txt 2>&1; say k8 $?; grep -E "^\| (megamoe|nccl)" $OUT/r/k8.md >> $L
fi
timeout $(cap 100) python3 -m pytest -q -m gpu -x -p no:cacheprovider tests/test_training.py -k gpu_gradients > $OUT/r/t2.txt 2>&1; say gpu_gradients $?; tail -2 $OUT/r/t2.txt >> $L
rm -f $OUT/r/s/*.json.gz; (cd $OUT && tar czf r.tgz r && rm -rf r)
grep -v "^\s*$" $L | tail -40
