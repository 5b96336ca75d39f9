# call 53 (.gpu/new = git archive HEAD src tests pyproject.toml benchmarks): the library's down (K = I <= 1024) and dx
# (K = 2I <= 2048) in ping-pong (off by default; each run sets them): their GPU bits tests through `down` and `dx` themselves, then the
# step A/B with MEGAMOE_PING_PONG_DOWN = MEGAMOE_PING_PONG_DX = 1 / 0 in alternating processes at sonic-7b (24576
# tokens) and qwen3-30b-a3b (8192), then each step per kernel with them on and off.
export MEGAMOE_COMMIT=$(cat $PWD/.gpu/COMMIT 2>/dev/null) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITON_CACHE_DIR=$PWD/.tcache
cd .gpu/new; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 570 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
nvidia-smi --query-gpu=name,power.limit,clocks.sm,memory.total --format=csv >> $L
timeout $(cap 150) python3 -m pytest -q -m gpu tests/test_experts.py -k "ping_pong or forward_ws or (gluon_dx and ping-pong)" -p no:cacheprovider > $OUT/r/tests.txt 2>&1; say tests $?
tail -3 $OUT/r/tests.txt >> $L
B="python3 -m megamoe bench --ep 1 --passes fwd,bwd,step --iters 5 --steady 1 --impl megamoe --experts bf16"
run() { local name=$1 c=$2 pp=$3; shift 3; MEGAMOE_PING_PONG_DOWN=$pp MEGAMOE_PING_PONG_DX=$pp timeout $(cap $c) $B "$@" --json $OUT/r/$name.json --md $OUT/r/$name.md > $OUT/r/$name.txt 2>&1; say "$name pp=$pp" $?; grep -E "^\| megamoe" $OUT/r/$name.md >> $L 2>/dev/null || tail -3 $OUT/r/$name.txt >> $L; }
for i in 1 2; do
  run s7_on_$i 60 1 --preset sonic-7b --tokens 24576
  run s7_off_$i 60 0 --preset sonic-7b --tokens 24576
done
for i in 1 2; do
  run q8_on_$i 50 1 --preset qwen3-30b-a3b --tokens 8192
  run q8_off_$i 50 0 --preset qwen3-30b-a3b --tokens 8192
done
for p in sonic-7b:24576 qwen3-30b-a3b:8192; do
  for pp in 1 0; do
    n=bk_${p%%:*}_pp$pp
    MEGAMOE_PING_PONG_DOWN=$pp MEGAMOE_PING_PONG_DX=$pp timeout $(cap 50) python3 benchmarks/backward_kernels.py --impl megamoe --rounds 3 --steady 1 --pass step --preset ${p%%:*} --tokens ${p##*:} --out $OUT/r/$n > $OUT/r/$n.txt 2>&1; say $n $?
    grep -E "ms between|kernels busy|dx_ws|dx_kernel|forward_ws|down_kernel|dact_ws|wgrad_ws|weighted" $OUT/r/$n.txt | head -12 >> $L
  done
done
(cd $OUT && tar czf r.tgz r && rm -rf r)
grep -v "^\s*$" $L | tail -60
