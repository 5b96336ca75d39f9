# call 40 (.gpu/new = git archive HEAD src tests pyproject.toml benchmarks): on an H100, qwen3-30b-a3b's mxfp8 step
# beside BF16 after the E4M3 ring's fill and one rank's x copies left (issue 50: >= 0.9x), both steps per kernel, and
# the BF16 step beside nccl-torch at 8192 / 16384 tokens (issue 49); on an H200, call_38's H200 branch instead
export MEGAMOE_COMMIT=$(cat $PWD/.gpu/COMMIT 2>/dev/null) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITON_CACHE_DIR=$PWD/.tcache
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
[ "$MEM" -gt 100000 ] && exec bash .gpu/call_38.sh
cd .gpu/new; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 560 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
nvidia-smi --query-gpu=name,power.limit,clocks.sm,memory.total --format=csv >> $L
B="python3 -m megamoe bench --ep 1 --passes fwd,bwd,step --iters 5 --steady 1 --preset qwen3-30b-a3b"
run() { local name=$1 c=$2; shift 2; timeout $(cap $c) "$@" --json $OUT/r/$name.json --md $OUT/r/$name.md > $OUT/r/$name.txt 2>&1; say "$name" $?; grep -E "^\| (megamoe|nccl)" $OUT/r/$name.md >> $L 2>/dev/null || tail -3 $OUT/r/$name.txt >> $L; }
K="python3 benchmarks/backward_kernels.py --impl megamoe --out $OUT/r --rounds 3 --steady 1 --preset qwen3-30b-a3b --pass step"
bk() { local name=$1 c=$2; shift 2; timeout $(cap $c) $K "$@" > $OUT/r/$name.txt 2>&1; say "$name" $?; tail -30 $OUT/r/$name.txt >> $L; }
run q8_mx 120 $B --impl megamoe --experts bf16,mxfp8 --tokens 8192
bk bk_q_mx 90 --experts mxfp8
bk bk_q_bf16 80 --experts bf16
run q8 90 $B --impl nccl-torch,megamoe --experts bf16 --tokens 8192
run q16 100 $B --impl nccl-torch,megamoe --experts bf16 --tokens 16384
(cd $OUT && tar czf r.tgz r && rm -rf r)
grep -v "^\s*$" $L | tail -120
