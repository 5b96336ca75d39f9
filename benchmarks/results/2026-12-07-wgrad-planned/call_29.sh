# call 29 (next GPU session; .gpu/new = git archive HEAD src tests pyproject.toml benchmarks): the steps call 28 ran out of time for: qwen3-30b-a3b 16384 zipf with the default skew (5: the plan deals), deepseek-v3 8192 uniform and zipf with it, and zipf with the static deal (skew inf); issue 49's zipf-within-10 % target
export MEGAMOE_COMMIT=$(cat $PWD/.gpu/COMMIT 2>/dev/null) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd .gpu/new; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 560 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
nvidia-smi --query-gpu=name,power.limit,clocks.sm,memory.total --format=csv >> $L
B="python3 -m megamoe bench --ep 1 --impl megamoe --passes fwd,bwd,step --iters 5 --steady 1"
run() { local name=$1; shift; timeout $(cap $1) "${@:2}" --json $OUT/r/$name.json --md $OUT/r/$name.md > $OUT/r/$name.txt 2>&1; say "$name" $?; grep -E "^\| megamoe" $OUT/r/$name.md >> $L 2>/dev/null || tail -3 $OUT/r/$name.txt >> $L; }
for load in "qwen3-30b-a3b 16384 zipf 5 100" "deepseek-v3 8192 uniform 5 140" "deepseek-v3 8192 zipf 5 140" "deepseek-v3 8192 zipf inf 120"; do
  set -- $load
  MEGAMOE_WGRAD_PLAN_SKEW=$4 run s$4_$1_$3 $5 $B --preset $1 --tokens $2 --routing $3
done
# the backward's host lead (the GPU idle from the start event to the first launch: ~1 ms of qwen3-30b-a3b's 6.3 ms
# backward between events, calls 25-27), with the host's operators and Python frames over it
timeout $(cap 90) python3 benchmarks/backward_kernels.py --impl megamoe --rounds 3 --steady 1 --pass bwd --host --preset qwen3-30b-a3b --tokens 16384 --out $OUT/r/host > $OUT/r/bk_host.txt 2>&1; say bk_host $?; grep -A14 "pass's ends" $OUT/r/bk_host.txt >> $L
(cd $OUT && tar czf r.tgz r && rm -rf r)
grep -v "^\s*$" $L | tail -40
