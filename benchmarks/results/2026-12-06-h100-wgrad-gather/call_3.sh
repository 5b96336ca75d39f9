# A3 (tree 4befb14+): GATHER_BACKWARD = d_out only, down wgrad gathering at BK 64: bits, then step A/B gather 0/1, per-kernel
export PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd .gpu; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 565 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
nvidia-smi --query-gpu=name,power.limit,clocks.sm,memory.total --format=csv >> $L
timeout $(cap 80) python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_experts.py -k "gathered_operands or wgrad" > $OUT/r/t_experts.txt 2>&1; say experts_gpu $?; tail -2 $OUT/r/t_experts.txt >> $L
MEGAMOE_GATHER_BACKWARD=1 timeout $(cap 80) python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_backward_ring.py -k "replayed and bf16" > $OUT/r/t_ring.txt 2>&1; say ring_gather $?; tail -2 $OUT/r/t_ring.txt >> $L
timeout $(cap 60) python3 benchmarks/wgrad_gather_ab.py --rounds 5 --out $OUT/r/ab.json > $OUT/r/ab.txt 2>&1; say ab $?; grep "^|" $OUT/r/ab.txt >> $L
for p in sonic-7b:24576 qwen3-30b-a3b:8192; do for g in 0 1 1 0; do
MEGAMOE_GATHER_BACKWARD=$g timeout $(cap 40) python3 -m megamoe bench --ep 1 --impl megamoe --preset ${p%%:*} --tokens ${p##*:} --passes bwd,step --iters 10 --json $OUT/r/b_${p%%:*}_g$g.json --md $OUT/r/b_${p%%:*}_g$g.md > $OUT/r/b_${p%%:*}_g$g.txt 2>&1; say "bench $p gather=$g" $?; grep -E "^\| (megamoe|nccl)" $OUT/r/b_${p%%:*}_g$g.md >> $L || tail -4 $OUT/r/b_${p%%:*}_g$g.txt >> $L
done; done
MEGAMOE_GATHER_BACKWARD=1 timeout $(cap 60) python3 benchmarks/backward_kernels.py --preset sonic-7b --tokens 24576 --impl megamoe --pass step --steady 2 --rounds 3 --top 12 --out $OUT/r/k_g1 > $OUT/r/k_g1.txt 2>&1; say "kernels sonic gather=1" $?; grep -E "ms  x|busy" $OUT/r/k_g1.txt >> $L
rm -f $OUT/r/*/*.json.gz; (cd $OUT && tar czf r.tgz r && rm -rf r)
grep -v "^\s*$" $L | tail -100
