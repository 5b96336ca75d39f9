# call 51 (.gpu/new = git archive HEAD src tests pyproject.toml benchmarks): down in ping-pong (the Gluon forward's
# warpgroups taking whole 128 x 128 tiles in turn) against the Triton down and the cooperative Gluon down at short K
# (fine-grained experts), its GPU bits test first; then the forward at sonic-7b per kernel (SonicMoE leads it).
export MEGAMOE_COMMIT=$(cat $PWD/.gpu/COMMIT 2>/dev/null) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITON_CACHE_DIR=$PWD/.tcache
cd .gpu/new; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 570 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
nvidia-smi --query-gpu=name,power.limit,clocks.sm,memory.total --format=csv >> $L
timeout $(cap 150) python3 -m pytest -q -m gpu tests/test_experts.py -k "ping_pong or forward_ws" -p no:cacheprovider > $OUT/r/tests.txt 2>&1; say tests $?
tail -3 $OUT/r/tests.txt >> $L
ab() { local name=$1; shift; (cd benchmarks && timeout $(cap 90) python3 tiles_ab.py --rounds 5 --seconds 0.3 "$@") > $OUT/r/$name.txt 2>&1; say $name $?; grep -E "^\||x ~" $OUT/r/$name.txt >> $L; }
ab sonic7b --preset sonic-7b --tokens 24576 --experts 128
ab qwen3 --preset qwen3-30b-a3b --tokens 8192 --experts 128
ab sonic120b --preset sonic-120b --tokens 32768 --experts 64
ab dsv3 --preset deepseek-v3 --tokens 8192 --experts 256
(cd $OUT && tar czf r.tgz r && rm -rf r)
grep -v "^\s*$" $L | tail -60
