# call 7: on an H200 the big presets' step in bf16 and fp8-block at 8192 tokens (kimi-k2 one format a process); on an H100 the FP8-wgrad A/B instead (MEGAMOE_FP8_BF16_WGRADS=0/1 at qwen3-30b-a3b 8192 and 16384)
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd .gpu; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 565 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
nvidia-smi --query-gpu=name,power.limit,clocks.sm,memory.total --format=csv >> $L
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
B="python3 -m megamoe bench --ep 1 --impl megamoe --passes fwd,bwd,step --iters 5 --steady 1"
run() { local name=$1 c=$2; shift 2; timeout $(cap $c) "$@" --json $OUT/r/$name.json --md $OUT/r/$name.md > $OUT/r/$name.txt 2>&1; say "$name" $?; grep -E "^\| (megamoe|nccl)" $OUT/r/$name.md >> $L 2>/dev/null || tail -3 $OUT/r/$name.txt >> $L; }
if [ "$MEM" -gt 100000 ]; then
  run glm5 150 $B --tokens 8192 --experts bf16,fp8-block --preset glm-5
  run dsv3 130 $B --tokens 8192 --experts bf16,fp8-block --preset deepseek-v3
  run kimi_bf16 130 $B --tokens 8192 --experts bf16 --preset kimi-k2
  run kimi_fp8 130 $B --tokens 8192 --experts fp8-block --preset kimi-k2
else
  for w in 0 1; do
    MEGAMOE_FP8_BF16_WGRADS=$w run q8_w$w 50 $B --experts bf16,fp8-block --preset qwen3-30b-a3b --tokens 8192
    MEGAMOE_FP8_BF16_WGRADS=$w run q16_w$w 60 $B --experts bf16,fp8-block --preset qwen3-30b-a3b --tokens 16384
  done
fi
(cd $OUT && tar czf r.tgz r && rm -rf r)
grep -v "^\s*$" $L | tail -60
