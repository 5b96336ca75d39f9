# call 1: the mxfp8 dact's by-token GPU test; today's defaults (fp8-block's BF16 wgrads below 384 rows an expert, mxfp8's always) at qwen3-30b-a3b (bf16/fp8-block/mxfp8), deepseek-v3 and, on an H200, kimi-k2 (bf16 and fp8-block interleaved in one process where they fit, else one process each); qwen3 fp8-block forced to BF16 wgrads
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd .gpu; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 565 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
nvidia-smi --query-gpu=name,power.limit,clocks.sm,memory.total --format=csv >> $L
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
timeout $(cap 90) python3 -m pytest -v -m gpu tests/test_experts_mxfp8_bf16.py -k by_token -p no:cacheprovider > $OUT/r/t_by_token.txt 2>&1; say t_by_token $?; grep -E "PASSED|FAILED|ERROR|passed|failed" $OUT/r/t_by_token.txt | tail -8 >> $L
B="python3 -m megamoe bench --ep 1 --impl megamoe --tokens 8192 --passes fwd,bwd,step --iters 5 --steady 1"
run() { local name=$1; shift; timeout $(cap $1) "${@:2}" --json $OUT/r/$name.json --md $OUT/r/$name.md > $OUT/r/$name.txt 2>&1; say "$name" $?; grep -E "^\| (megamoe|nccl)" $OUT/r/$name.md >> $L 2>/dev/null || tail -3 $OUT/r/$name.txt >> $L; }
run q 80 $B --experts bf16,fp8-block,mxfp8 --preset qwen3-30b-a3b
if [ "$MEM" -gt 100000 ]; then
  run kimi 170 $B --experts bf16,fp8-block --preset kimi-k2
  run dsv3 130 $B --experts bf16,fp8-block --preset deepseek-v3
else
  run dsv3_fp8 95 $B --experts fp8-block --preset deepseek-v3
  run dsv3_bf16 95 $B --experts bf16 --preset deepseek-v3
fi
MEGAMOE_FP8_BF16_WGRADS=1 run q_w1 60 $B --experts bf16,fp8-block --preset qwen3-30b-a3b
(cd $OUT && tar czf r.tgz r && rm -rf r)
grep -v "^\s*$" $L | tail -60
