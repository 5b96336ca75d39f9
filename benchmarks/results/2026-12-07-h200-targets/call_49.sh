# call 49 (.gpu/new = git archive HEAD src tests pyproject.toml benchmarks): on an H200, issue 49's BF16 steps beside
# nccl-torch (kimi-k2: step >= 1.5x, backward <= 26.5 ms; deepseek-v3; qwen3-30b-a3b) and issue 50's fp8-block /
# mxfp8 steps beside BF16 (fp8-block >= 1.4x, mxfp8 >= 0.9x; at kimi-k2 and deepseek-v3 fp8-block alone in its process). On an H100 the kimi-k2 run is skipped.
export MEGAMOE_COMMIT=$(cat $PWD/.gpu/COMMIT 2>/dev/null) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITON_CACHE_DIR=$PWD/.tcache
cd .gpu/new; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 570 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
nvidia-smi --query-gpu=name,power.limit,clocks.sm,memory.total --format=csv >> $L
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
B="python3 -m megamoe bench --ep 1 --passes fwd,bwd,step --iters 5 --steady 1 --tokens 8192"
run() { local name=$1 c=$2; shift 2; timeout $(cap $c) "$@" --json $OUT/r/$name.json --md $OUT/r/$name.md > $OUT/r/$name.txt 2>&1; say "$name" $?; grep -E "^\| (megamoe|nccl)" $OUT/r/$name.md >> $L 2>/dev/null || tail -3 $OUT/r/$name.txt >> $L; }
run q8 100 $B --impl nccl-torch,megamoe --experts bf16,fp8-block,mxfp8 --preset qwen3-30b-a3b
[ "$MEM" -gt 100000 ] && run kimi_bf16 170 $B --impl nccl-torch,megamoe --experts bf16 --preset kimi-k2
run d8 140 $B --impl nccl-torch,megamoe --experts bf16 --preset deepseek-v3
# both formats' weights, gradients and packs do not fit one process at these shapes (2026-12-06-h200-keyed-pool-step)
run d8_fp8 100 $B --impl megamoe --experts fp8-block --preset deepseek-v3
[ "$MEM" -gt 100000 ] && run kimi_fp8 110 $B --impl megamoe --experts fp8-block --preset kimi-k2
(cd $OUT && tar czf r.tgz r && rm -rf r)
grep -v "^\s*$" $L | tail -40
