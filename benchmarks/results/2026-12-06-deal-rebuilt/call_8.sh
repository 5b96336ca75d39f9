# call 8: where the backward's time goes per kernel at the big shapes, and the FP8 formats' step against BF16's. On an H200 kimi-k2 8192 bwd per kernel in bf16 and fp8-block (one process each); on an H100 deepseek-v3 8192 bwd per kernel in fp8-block; on either qwen3-30b-a3b 8192 step bf16,fp8-block,mxfp8 against nccl-torch
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd .gpu; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 420 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
nvidia-smi --query-gpu=name,power.limit,clocks.sm,memory.total --format=csv >> $L
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
K="python3 benchmarks/backward_kernels.py --impl megamoe --rounds 3 --steady 1 --pass bwd --out $OUT/r"
bk() { local name=$1; shift; timeout $(cap 120) $K "$@" > $OUT/r/$name.txt 2>&1; say "$name" $?; grep -E "between events|^ +[0-9.]+ ms +[0-9.]+ %|^ +[0-9.]+ ms +x" $OUT/r/$name.txt | head -14 >> $L; }
if [ "$MEM" -gt 100000 ]; then
  bk kimi_bf16 --preset kimi-k2
  bk kimi_fp8 --preset kimi-k2 --experts fp8-block
else
  bk dsv3_fp8 --preset deepseek-v3 --experts fp8-block
fi
timeout $(cap 120) python3 -m megamoe bench --ep 1 --impl nccl-torch,megamoe --passes fwd,bwd,step --iters 5 --steady 1 --preset qwen3-30b-a3b --tokens 8192 --experts bf16,fp8-block,mxfp8 --json $OUT/r/q8.json --md $OUT/r/q8.md > $OUT/r/q8.txt 2>&1; say q8 $?; grep -E "^\| (megamoe|nccl)" $OUT/r/q8.md >> $L 2>/dev/null || tail -3 $OUT/r/q8.txt >> $L
(cd $OUT && tar czf r.tgz r && rm -rf r)
grep -v "^\s*$" $L | tail -70
