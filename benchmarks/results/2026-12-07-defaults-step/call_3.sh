# call 3: issue 49's cliffs at today's tree: deepseek-v3 at 16384 tokens against nccl-torch (H200) and zipf routing at deepseek-v3, kimi-k2 (H200) and qwen3-30b-a3b, BF16, each against the uniform run of calls 1-2 on the same machine
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd .gpu; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 565 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
nvidia-smi --query-gpu=name,power.limit,clocks.sm,memory.total --format=csv >> $L
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
B="python3 -m megamoe bench --ep 1 --passes fwd,bwd,step --iters 5 --steady 1"
run() { local name=$1; shift; timeout $(cap $1) "${@:2}" --json $OUT/r/$name.json --md $OUT/r/$name.md > $OUT/r/$name.txt 2>&1; say "$name" $?; grep -E "^\| (megamoe|nccl)" $OUT/r/$name.md >> $L 2>/dev/null || tail -3 $OUT/r/$name.txt >> $L; }
run q16_zipf 70 $B --impl megamoe --preset qwen3-30b-a3b --tokens 16384 --routing zipf
run q16 70 $B --impl megamoe --preset qwen3-30b-a3b --tokens 16384
if [ "$MEM" -gt 100000 ]; then
  run dsv3_16k 200 $B --impl nccl-torch,megamoe --preset deepseek-v3 --tokens 16384
  run dsv3_zipf 100 $B --impl megamoe --preset deepseek-v3 --tokens 8192 --routing zipf
  run kimi_zipf 130 $B --impl megamoe --preset kimi-k2 --tokens 8192 --routing zipf
else
  run dsv3_zipf 100 $B --impl megamoe --preset deepseek-v3 --tokens 8192 --routing zipf
  run dsv3_uni 100 $B --impl megamoe --preset deepseek-v3 --tokens 8192
fi
(cd $OUT && tar czf r.tgz r && rm -rf r)
grep -v "^\s*$" $L | tail -60
