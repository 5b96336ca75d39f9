# call 32 (after call 31, the same tree): on an H200 kimi-k2's BF16 step beside nccl-torch (issue 49: step >= 1.5x,
# backward <= 26.5 ms) and the fp8-block steps of issue 50 (kimi-k2 alone in its process; deepseek-v3 and glm-5 with
# BF16 in the same rounds)
export MEGAMOE_COMMIT=$(cat $PWD/.gpu/COMMIT 2>/dev/null) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITON_CACHE_DIR=$PWD/.tcache
cd .gpu/new; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 560 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
nvidia-smi --query-gpu=name,power.limit,clocks.sm,memory.total --format=csv >> $L
B="python3 -m megamoe bench --ep 1 --passes fwd,bwd,step --iters 5 --steady 1 --tokens 8192"
run() { local name=$1 c=$2; shift 2; timeout $(cap $c) "$@" --json $OUT/r/$name.json --md $OUT/r/$name.md > $OUT/r/$name.txt 2>&1; say "$name" $?; grep -E "^\| (megamoe|nccl)" $OUT/r/$name.md >> $L 2>/dev/null || tail -3 $OUT/r/$name.txt >> $L; }
run kimi_bf16 170 $B --impl nccl-torch,megamoe --experts bf16 --preset kimi-k2
run kimi_fp8 130 $B --impl megamoe --experts fp8-block --preset kimi-k2
run d8_fp8 130 $B --impl megamoe --experts bf16,fp8-block --preset deepseek-v3
run glm5 150 $B --impl megamoe --experts bf16,fp8-block --preset glm-5
(cd $OUT && tar czf r.tgz r && rm -rf r)
grep -v "^\s*$" $L | tail -40
