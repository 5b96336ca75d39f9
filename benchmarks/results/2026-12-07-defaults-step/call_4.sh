# call 4: the mxfp8 dact's by-token test (it carries no gpu mark: call 1's `-m gpu` selected nothing); where zipf routing's extra backward time goes: deepseek-v3 at 8192 and qwen3-30b-a3b at 16384 tokens, BF16 backward per kernel under zipf and uniform routing
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd .gpu; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 300 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
timeout $(cap 60) python3 -m pytest -v tests/test_experts_mxfp8_bf16.py -k by_token -p no:cacheprovider > $OUT/r/t_by_token.txt 2>&1; say t_by_token $?; grep -E "PASSED|FAILED|ERROR|passed|failed" $OUT/r/t_by_token.txt | tail -8 >> $L
K="python3 benchmarks/backward_kernels.py --impl megamoe --out $OUT/r --rounds 3 --steady 1 --pass bwd"
bk() { local name=$1 c=$2; shift 2; timeout $(cap $c) $K "$@" > $OUT/r/$name.txt 2>&1; say "$name" $?; grep -E "ms .*%|ms  x" $OUT/r/$name.txt | head -16 >> $L; grep -E "between events" $OUT/r/$name.txt >> $L; }
bk bk_dsv3_zipf 75 --preset deepseek-v3 --routing zipf
bk bk_dsv3_uni 70 --preset deepseek-v3
bk bk_q16_zipf 40 --preset qwen3-30b-a3b --tokens 16384 --routing zipf
bk bk_q16_uni 40 --preset qwen3-30b-a3b --tokens 16384
(cd $OUT && tar czf r.tgz r && rm -rf r)
grep -v "^\s*$" $L | tail -100
