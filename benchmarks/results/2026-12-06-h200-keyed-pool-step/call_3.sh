# C3 (H200, 7e4d74a, KEYED_POOL=1): deepseek-v3 bf16 vs nccl-torch; fp8-block alone at kimi-k2 / deepseek-v3; qwen3 GATHER_X 0/1
export PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 MEGAMOE_KEYED_POOL=1
cd .gpu; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 390 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
nvidia-smi --query-gpu=name,power.limit,clocks.sm,memory.total --format=csv >> $L
B="python3 -m megamoe bench --ep 1 --tokens 8192 --passes fwd,bwd,step --iters 5 --steady 1"
MEGAMOE_GATHER_X=1 timeout $(cap 110) $B --impl nccl-torch,megamoe --experts bf16 --preset deepseek-v3 --json $OUT/r/dsv3_bf16.json --md $OUT/r/dsv3_bf16.md > $OUT/r/dsv3_bf16.txt 2>&1; say dsv3_bf16 $?; grep -E "^\| (megamoe|nccl)" $OUT/r/dsv3_bf16.md >> $L || tail -3 $OUT/r/dsv3_bf16.txt >> $L
timeout $(cap 90) $B --impl megamoe --experts fp8-block --preset kimi-k2 --json $OUT/r/kimi_fp8.json --md $OUT/r/kimi_fp8.md > $OUT/r/kimi_fp8.txt 2>&1; say kimi_fp8 $?; grep -E "^\| (megamoe|nccl)" $OUT/r/kimi_fp8.md >> $L || tail -3 $OUT/r/kimi_fp8.txt >> $L
timeout $(cap 80) $B --impl megamoe --experts fp8-block --preset deepseek-v3 --json $OUT/r/dsv3_fp8.json --md $OUT/r/dsv3_fp8.md > $OUT/r/dsv3_fp8.txt 2>&1; say dsv3_fp8 $?; grep -E "^\| (megamoe|nccl)" $OUT/r/dsv3_fp8.md >> $L || tail -3 $OUT/r/dsv3_fp8.txt >> $L
for g in 0 1; do
MEGAMOE_GATHER_X=$g timeout $(cap 40) python3 -m megamoe bench --ep 1 --impl megamoe --preset qwen3-30b-a3b --tokens 8192 --passes bwd,step --iters 10 --json $OUT/r/q_g$g.json --md $OUT/r/q_g$g.md > $OUT/r/q_g$g.txt 2>&1; say "qwen3 gather_x=$g" $?; grep -E "^\| (megamoe|nccl)" $OUT/r/q_g$g.md >> $L || tail -3 $OUT/r/q_g$g.txt >> $L
done
(cd $OUT && tar czf r.tgz r && rm -rf r)
grep -v "^\s*$" $L | tail -60
