# C1 (5578666): fp8_wgrad_ab; deepseek-v3 bf16+fp8-block and qwen3 bf16+mxfp8 with MEGAMOE_FP8_BF16_WGRADS=0/1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd .gpu; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 570 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
nvidia-smi --query-gpu=name,power.limit,clocks.sm,memory.total --format=csv >> $L
timeout $(cap 60) python3 -m pytest -q -m gpu tests/test_experts_fp8_bwd.py -k "slots" -p no:cacheprovider > $OUT/r/t_slots.txt 2>&1; say t_slots $?; tail -2 $OUT/r/t_slots.txt >> $L
timeout $(cap 130) python3 benchmarks/fp8_wgrad_ab.py --rounds 5 --out $OUT/r/fp8_wgrad_ab.json > $OUT/r/fp8_wgrad_ab.txt 2>&1; say fp8_wgrad_ab $?; tail -30 $OUT/r/fp8_wgrad_ab.txt >> $L
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1); DX=bf16,fp8-block; [ "$MEM" -lt 100000 ] && DX=fp8-block
B="python3 -m megamoe bench --ep 1 --impl megamoe --tokens 8192 --passes fwd,bwd,step --iters 5 --steady 1"
for w in 0 1; do
MEGAMOE_FP8_BF16_WGRADS=$w timeout $(cap 110) $B --experts $DX --preset deepseek-v3 --json $OUT/r/dsv3_w$w.json --md $OUT/r/dsv3_w$w.md > $OUT/r/dsv3_w$w.txt 2>&1; say "dsv3 bf16_wgrads=$w" $?; grep -E "^\| (megamoe|nccl)" $OUT/r/dsv3_w$w.md >> $L || tail -3 $OUT/r/dsv3_w$w.txt >> $L
done
for w in 0 1; do
MEGAMOE_FP8_BF16_WGRADS=$w timeout $(cap 70) $B --experts bf16,mxfp8 --preset qwen3-30b-a3b --json $OUT/r/q_w$w.json --md $OUT/r/q_w$w.md > $OUT/r/q_w$w.txt 2>&1; say "qwen3 mxfp8 bf16_wgrads=$w" $?; grep -E "^\| (megamoe|nccl)" $OUT/r/q_w$w.md >> $L || tail -3 $OUT/r/q_w$w.txt >> $L
done
(cd $OUT && tar czf r.tgz r && rm -rf r)
grep -v "^\s*$" $L | tail -70
