# What 98492a6.. changed with only its bits GPU-tested: the composed backward's windows replay from a CUDA graph.
export PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd .gpu; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 560 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
nvidia-smi --query-gpu=name,power.limit,clocks.sm,memory.total --format=csv >> $L
# 1. the layer's gradients and a soak with the backward's graphs (the training test takes ~165 s)
timeout $(cap 200) python3 -m pytest -q -m gpu -x -p no:cacheprovider tests/test_training.py -k gpu_gradients > $OUT/r/t1.txt 2>&1; say gpu_gradients $?; tail -2 $OUT/r/t1.txt >> $L
MEGAMOE_SOAK_GPU_PASSES=100 timeout $(cap 120) python3 -m pytest -q -m gpu -x -p no:cacheprovider tests/test_soak.py > $OUT/r/t2.txt 2>&1; say soak $?; tail -2 $OUT/r/t2.txt >> $L
# 2. the step's gaps with the graph (--host: what the host did around each gap), then the host's issue time
for p in qwen3-30b-a3b:8192 sonic-7b:24576; do
timeout $(cap 70) python3 benchmarks/backward_kernels.py --preset ${p%%:*} --tokens ${p##*:} --impl megamoe --pass step --host --steady 3 --rounds 3 --out $OUT/r/s > $OUT/r/s_${p%%:*}.txt 2>&1; say "step $p" $?; grep -E "ms between|graphs after|gaps between" $OUT/r/s_${p%%:*}.txt >> $L
done
timeout $(cap 90) python3 host_profile.py $OUT/r > $OUT/r/host.txt 2>&1; say host $?; tail -3 $OUT/r/host.txt >> $L
timeout $(cap 150) python3 -m megamoe bench --ep 1 --impl nccl-torch,megamoe --preset qwen3-30b-a3b --tokens 16384 --passes fwd,bwd,step --iters 10 --json $OUT/r/q16.json --md $OUT/r/q16.md > $OUT/r/q16.txt 2>&1; say q16 $?; grep -E "^\| (megamoe|nccl)" $OUT/r/q16.md >> $L
rm -f $OUT/r/s/*.json.gz; (cd $OUT && tar czf r.tgz r && rm -rf r)
grep -v "^\s*$" $L | tail -40
# call B (H200 only, needs_h200: kimi-k2 at EP 1 with nccl-torch needs > 80 GB): benchmarks/results/2026-12-06-h100-backward-graphs/98492a6/run.sh's
#   kimi-k2 line: megamoe bench --ep 1 --impl nccl-torch,megamoe --experts bf16,fp8-block --preset kimi-k2 --tokens 8192
#   --passes fwd,bwd,step --iters 5 --steady 1 (issue 49: bwd <= 26.5 ms, step >= 1.5x; issue 50: fp8-block step >= 1.4x bf16);
#   then deepseek-v3 the same.
