# call 56 (.gpu/new = git archive HEAD src tests pyproject.toml benchmarks; any Hopper; after call 55): the dx in its
# cooperative Gluon form (MEGAMOE_GLUON_DX, off by default): its GPU bits tests (ping-pong, cooperative, cooperative
# with SKIP_EMPTY_HALF, rows and slots), then the BF16 expert backward's tile variants in interleaved rounds
# (backward_tiles_ab.py: the plan, SKIP_EMPTY_HALF, dx at 128 x 256 in Triton / Gluon / Gluon with SKIP_EMPTY_HALF)
# at kimi-k2's ~170 rows an expert (192 experts, half its weights) and deepseek-v3's shape at ~258.
export MEGAMOE_COMMIT=$(cat $PWD/.gpu/COMMIT 2>/dev/null) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITON_CACHE_DIR=$PWD/.tcache
cd .gpu/new; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 570 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
nvidia-smi --query-gpu=name,power.limit,clocks.sm,memory.total --format=csv >> $L
timeout $(cap 150) python3 -m pytest -q -m gpu tests/test_experts.py -k "gluon_dx" -p no:cacheprovider > $OUT/r/tests.txt 2>&1; say tests $?
tail -3 $OUT/r/tests.txt >> $L
ab() { local name=$1; shift; (cd benchmarks && timeout $(cap 120) python3 backward_tiles_ab.py --rounds 5 --seconds 0.4 "$@" > $OUT/r/$name.txt 2>&1); say "$name" $?; grep -E "^\||rounds" $OUT/r/$name.txt >> $L; }
PYTHONPATH=$PWD/src ab kimi --preset kimi-k2 --experts 192 --tokens 4096
PYTHONPATH=$PWD/src ab dsv3 --preset deepseek-v3 --experts 128 --tokens 4125
(cd $OUT && tar czf r.tgz r && rm -rf r)
grep -v "^\s*$" $L | tail -60
