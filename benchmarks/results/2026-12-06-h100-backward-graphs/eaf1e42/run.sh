# Next GPU session, call A (tree = HEAD via git archive into .gpu; carry [".gpu"]; run from repo root: bash .gpu/a.sh)
# What f1316bd changed without a whole-step GPU run: GATHER_FORWARD on by default (the forward's gate/up gathers x),
# WEIGHTED_SUM_TILE (2, 1024, 2). Check the layer with them, then time the step against the tree before.
export PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd .gpu; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 560 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
nvidia-smi --query-gpu=name,power.limit,clocks.sm,memory.total --format=csv >> $L
# 1. the layer against the oracle with the new defaults (forward gathers in the BF16 and MXFP8-as-BF16 forwards)
timeout $(cap 200) python3 -m pytest -q -m gpu -x -p no:cacheprovider tests/test_training.py -k gpu_gradients > $OUT/r/t1.txt 2>&1; say gpu_gradients $?; tail -2 $OUT/r/t1.txt >> $L
timeout $(cap 100) python3 -m pytest -q -x -p no:cacheprovider -m "not slow" tests/test_experts_mxfp8_bf16.py > $OUT/r/t2.txt 2>&1; say mxbf16 $?; tail -2 $OUT/r/t2.txt >> $L
# 2. the step, forward gathers on / off (steady 3 s: the first run compiles), then megamoe bench against nccl-torch
for p in sonic-7b:24576 qwen3-30b-a3b:8192; do for g in 1 0; do
MEGAMOE_GATHER_FORWARD=$g timeout $(cap 60) python3 benchmarks/backward_kernels.py --preset ${p%%:*} --tokens ${p##*:} --impl megamoe --pass step --steady 3 --rounds 3 --out $OUT/r/g$g > $OUT/r/g${g}_${p%%:*}.txt 2>&1; say "g$g $p" $?; grep -E "ms between|graphs after" $OUT/r/g${g}_${p%%:*}.txt >> $L
done; done
timeout $(cap 150) python3 -m megamoe bench --ep 1 --impl nccl-torch,megamoe --preset qwen3-30b-a3b --tokens 8192 --passes fwd,bwd,step --iters 10 --json $OUT/r/q8.json --md $OUT/r/q8.md > $OUT/r/q8.txt 2>&1; say q8 $?; grep -E "^\|" $OUT/r/q8.md >> $L
timeout $(cap 120) python3 host_profile.py $OUT/r > $OUT/r/host.txt 2>&1; say host $?; tail -3 $OUT/r/host.txt >> $L
rm -f $OUT/r/g1/*.json.gz; (cd $OUT && tar czf r.tgz r && rm -rf r)
