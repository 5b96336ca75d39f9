# GPU call A (tree = HEAD via git archive into .gpu; carry [".gpu"]; run from repo root: bash .gpu/a.sh)
export PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd .gpu; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 560 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
nvidia-smi --query-gpu=name,power.limit,clocks.sm,memory.total --format=csv >> $L
# 1. built without a GPU: noinc gathers (a wrong barrier count hangs: the timeout names it)
timeout $(cap 90) python3 -m pytest -q -m gpu -x -p no:cacheprovider tests/test_experts.py -k gathered_operands > $OUT/r/t1.txt 2>&1; say gathers $?; tail -2 $OUT/r/t1.txt >> $L
# 2. the step per kernel, gathers on and off (+ host ops, graph captures)
for p in qwen3-30b-a3b:8192 sonic-7b:24576; do for g in 1 0; do
MEGAMOE_GATHER_ON_LOAD=$g timeout $(cap 60) python3 benchmarks/backward_kernels.py --preset ${p%%:*} --tokens ${p##*:} --impl megamoe --pass step --steady 1 --rounds 3 --host --out $OUT/r/g$g > $OUT/r/g${g}_${p%%:*}.txt 2>&1; say "g$g $p" $?; grep -E "ms between|graphs after" $OUT/r/g${g}_${p%%:*}.txt >> $L
done; done
# 3. weighted sums across tiles
timeout $(cap 80) python3 benchmarks/weighted_sum_bench.py --shapes qwen3-30b-a3b,sonic-7b,sonic-d4096,kimi-k2 --out $OUT/r/wsum.json > $OUT/r/wsum.txt 2>&1; say wsum $?
# 4. where MXFP8-as-BF16's step goes
timeout $(cap 70) python3 benchmarks/backward_kernels.py --preset qwen3-30b-a3b --tokens 8192 --impl megamoe --experts mxfp8 --pass step --steady 1 --rounds 3 --out $OUT/r/mx > $OUT/r/mx.txt 2>&1; say mxsteps $?
# 5. MXFP8 as BF16 (the default since 2026-12-06) against its tests
timeout $(cap 150) python3 -m pytest -q -x -p no:cacheprovider -m "not slow" tests/test_experts_mxfp8_bf16.py > $OUT/r/t2.txt 2>&1; say mxbf16 $?; tail -2 $OUT/r/t2.txt >> $L
rm -f $OUT/r/g1/*.json.gz $OUT/r/mx/*.json.gz; (cd $OUT && tar czf r.tgz r && rm -rf r)
grep -v "^\s*$" $L | tail -40
