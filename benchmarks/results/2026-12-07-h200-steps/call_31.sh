# call 31 (.gpu/new = git archive HEAD src tests pyproject.toml benchmarks): on an H200, issue 49's BF16 step targets side
# by side with nccl-torch (qwen3-30b-a3b at 8192 and 16384 tokens, deepseek-v3 at 8192) and the zipf-within-10 % one
# (megamoe with the default plan skew); on an H100 the GPU poison probe instead (call_37.sh of
# 2026-12-07-ring-poison-probe, copied to .gpu/ with its poison.py and sitecustomize.py in .gpu/probe/)
export MEGAMOE_COMMIT=$(cat $PWD/.gpu/COMMIT 2>/dev/null) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITON_CACHE_DIR=$PWD/.tcache
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
[ "$MEM" -lt 100000 ] && exec bash .gpu/call_37.sh
cd .gpu/new; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 560 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
nvidia-smi --query-gpu=name,power.limit,clocks.sm,memory.total --format=csv >> $L
B="python3 -m megamoe bench --ep 1 --passes fwd,bwd,step --iters 5 --steady 1 --experts bf16"
run() { local name=$1 c=$2; shift 2; timeout $(cap $c) "$@" --json $OUT/r/$name.json --md $OUT/r/$name.md > $OUT/r/$name.txt 2>&1; say "$name" $?; grep -E "^\| (megamoe|nccl)" $OUT/r/$name.md >> $L 2>/dev/null || tail -3 $OUT/r/$name.txt >> $L; }
run q8 70 $B --impl nccl-torch,megamoe --preset qwen3-30b-a3b --tokens 8192
run q16 80 $B --impl nccl-torch,megamoe --preset qwen3-30b-a3b --tokens 16384
run q16z 70 $B --impl megamoe --preset qwen3-30b-a3b --tokens 16384 --routing zipf
run d8 160 $B --impl nccl-torch,megamoe --preset deepseek-v3 --tokens 8192
run d8z 120 $B --impl megamoe --preset deepseek-v3 --tokens 8192 --routing zipf
(cd $OUT && tar czf r.tgz r && rm -rf r)
grep -v "^\s*$" $L | tail -40
