# C2 (H200, 7e4d74a, KEYED_POOL=1 GATHER_X=1): kimi-k2 / deepseek-v3 at EP 1, 8192 tokens: megamoe vs nccl-torch (bf16), fp8-block vs bf16
export PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd .gpu; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 575 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
nvidia-smi --query-gpu=name,power.limit,clocks.sm,memory.total --format=csv >> $L
B="python3 -m megamoe bench --ep 1 --tokens 8192 --passes fwd,bwd,step --iters 5 --steady 1"
timeout $(cap 200) $B --impl nccl-torch,megamoe --experts bf16 --preset kimi-k2 --json $OUT/r/kimi_bf16.json --md $OUT/r/kimi_bf16.md > $OUT/r/kimi_bf16.txt 2>&1; say kimi_bf16 $?; grep -E "^\| (megamoe|nccl)" $OUT/r/kimi_bf16.md >> $L || tail -5 $OUT/r/kimi_bf16.txt >> $L
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout $(cap 200) $B --impl megamoe --experts bf16,fp8-block --preset kimi-k2 --json $OUT/r/kimi_fp8.json --md $OUT/r/kimi_fp8.md > $OUT/r/kimi_fp8.txt 2>&1; say kimi_fp8 $?; grep -E "^\| (megamoe|nccl)" $OUT/r/kimi_fp8.md >> $L || tail -5 $OUT/r/kimi_fp8.txt >> $L
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout $(cap 200) $B --impl nccl-torch,megamoe --experts bf16,fp8-block --preset deepseek-v3 --json $OUT/r/dsv3.json --md $OUT/r/dsv3.md > $OUT/r/dsv3.txt 2>&1; say dsv3 $?; grep -E "^\| (megamoe|nccl)" $OUT/r/dsv3.md >> $L || tail -5 $OUT/r/dsv3.txt >> $L
(cd $OUT && tar czf r.tgz r && rm -rf r)
grep -v "^\s*$" $L | tail -60
