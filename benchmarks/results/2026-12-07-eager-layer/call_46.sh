# call 46 (.gpu/new = git archive HEAD src tests pyproject.toml benchmarks): the BF16 step beside nccl-torch after
# moe's eager path left the custom-op dispatch (EagerLayer): qwen3-30b-a3b at 8192 and 16384 tokens (issue 49: step
# >= 1.5x, 16384 <= 2.1x the 8192 step); on an H200 kimi-k2's (step >= 1.5x, backward <= 26.5 ms) and deepseek-v3's
# BF16 beside fp8-block (issue 50: >= 1.4x); on an H100 deepseek-v3's step under zipf and uniform routing (within 10 %)
export MEGAMOE_COMMIT=$(cat $PWD/.gpu/COMMIT 2>/dev/null) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITON_CACHE_DIR=$PWD/.tcache
cd .gpu/new; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 560 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
nvidia-smi --query-gpu=name,power.limit,clocks.sm,memory.total --format=csv >> $L
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
B="python3 -m megamoe bench --ep 1 --passes fwd,bwd,step --iters 5 --steady 1"
run() { local name=$1 c=$2; shift 2; timeout $(cap $c) "$@" --json $OUT/r/$name.json --md $OUT/r/$name.md > $OUT/r/$name.txt 2>&1; say "$name" $?; grep -E "^\| (megamoe|nccl)" $OUT/r/$name.md >> $L 2>/dev/null || tail -3 $OUT/r/$name.txt >> $L; }
run q8 110 $B --impl nccl-torch,megamoe --experts bf16 --preset qwen3-30b-a3b --tokens 8192
run q16 130 $B --impl nccl-torch,megamoe --experts bf16 --preset qwen3-30b-a3b --tokens 16384
if [ "$MEM" -gt 100000 ]; then
  run kimi_bf16 170 $B --impl nccl-torch,megamoe --experts bf16 --preset kimi-k2 --tokens 8192
  run d8_fp8 140 $B --impl megamoe --experts bf16,fp8-block --preset deepseek-v3 --tokens 8192
else
  run d8_zipf 150 $B --impl megamoe --experts bf16 --preset deepseek-v3 --tokens 8192 --routing zipf
  run d8_uni 150 $B --impl megamoe --experts bf16 --preset deepseek-v3 --tokens 8192
fi
(cd $OUT && tar czf r.tgz r && rm -rf r)
grep -v "^\s*$" $L | tail -40
