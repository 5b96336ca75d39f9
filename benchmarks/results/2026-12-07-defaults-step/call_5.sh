# call 5: where FP8 wgrads pay in the fp8-block step: MEGAMOE_FP8_BF16_WGRADS=0 (FP8 wgrads) / 1 (BF16 wgrads) at qwen3-30b-a3b 8192 and 16384 tokens (512 and 1024 rows an expert), BF16 in each process
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd .gpu; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 190 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
nvidia-smi --query-gpu=name,power.limit,clocks.sm,memory.total --format=csv >> $L
B="python3 -m megamoe bench --ep 1 --impl megamoe --experts bf16,fp8-block --passes fwd,bwd,step --iters 5 --steady 1"
run() { local name=$1; shift; timeout $(cap $1) "${@:2}" --json $OUT/r/$name.json --md $OUT/r/$name.md > $OUT/r/$name.txt 2>&1; say "$name" $?; grep -E "^\| (megamoe|nccl).*step" $OUT/r/$name.md >> $L 2>/dev/null || tail -3 $OUT/r/$name.txt >> $L; }
for w in 0 1; do
  MEGAMOE_FP8_BF16_WGRADS=$w run q8_w$w 50 $B --preset qwen3-30b-a3b --tokens 8192
  MEGAMOE_FP8_BF16_WGRADS=$w run q16_w$w 60 $B --preset qwen3-30b-a3b --tokens 16384
done
(cd $OUT && tar czf r.tgz r && rm -rf r)
grep -v "^\s*$" $L | tail -40
