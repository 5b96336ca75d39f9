# call 55 (.gpu/new = git archive HEAD src tests pyproject.toml benchmarks; any Hopper): SKIP_EMPTY_HALF (a 128-row
# Gluon tile of at most 64 rows in one warpgroup; off by default): its GPU bits tests, then the expert forward's tiles
# in interleaved rounds at kimi-k2's ~170-row experts (tails of 42-43 rows; BF16 and fp8-block) and deepseek-v3's
# shape at ~258 rows (tails of 1-2), then the deepseek-v3 BF16 step with MEGAMOE_SKIP_EMPTY_HALF = 1 / 0 in
# alternating processes (the bench's routing: 257 +- 16 rows an expert).
export MEGAMOE_COMMIT=$(cat $PWD/.gpu/COMMIT 2>/dev/null) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITON_CACHE_DIR=$PWD/.tcache
cd .gpu/new; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 570 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
nvidia-smi --query-gpu=name,power.limit,clocks.sm,memory.total --format=csv >> $L
timeout $(cap 170) python3 -m pytest -q -m gpu tests/test_experts.py tests/test_experts_fp8.py tests/test_experts_fp8_bwd.py -k "empty" -p no:cacheprovider > $OUT/r/tests.txt 2>&1; say tests $?
tail -3 $OUT/r/tests.txt >> $L
ab() { local name=$1; shift; (cd benchmarks && timeout $(cap 60) python3 tiles_ab.py --rounds 5 --seconds 0.3 "$@" > $OUT/r/$name.txt 2>&1); say "$name" $?; grep -E "^\||rounds" $OUT/r/$name.txt >> $L; }
PYTHONPATH=$PWD/src ab kimi_bf16 --preset kimi-k2 --experts 384
PYTHONPATH=$PWD/src ab kimi_fp8 --preset kimi-k2 --experts 384 --precision fp8-block
PYTHONPATH=$PWD/src ab dsv3_bf16 --preset deepseek-v3 --experts 256 --tokens 8250
B="python3 -m megamoe bench --ep 1 --passes fwd,bwd,step --iters 5 --steady 1 --impl megamoe --experts bf16 --preset deepseek-v3 --tokens 8192"
for i in 1 2; do
  for s in 1 0; do
    n=dsv3_skip${s}_$i
    MEGAMOE_SKIP_EMPTY_HALF=$s timeout $(cap 80) $B --json $OUT/r/$n.json --md $OUT/r/$n.md > $OUT/r/$n.txt 2>&1; say "$n" $?
    grep -E "^\| megamoe" $OUT/r/$n.md >> $L 2>/dev/null || tail -3 $OUT/r/$n.txt >> $L
  done
done
(cd $OUT && tar czf r.tgz r && rm -rf r)
grep -v "^\s*$" $L | tail -60
