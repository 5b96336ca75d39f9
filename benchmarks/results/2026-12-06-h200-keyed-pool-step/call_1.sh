# C1 (7e4d74a): KeyedPool loop test, OUT_T wgrad bits, gate/up gather A/B, GATHER_X ring test, bench keyed/gather-x at sonic-7b
export PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd .gpu; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 570 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
nvidia-smi --query-gpu=name,power.limit,clocks.sm,memory.total --format=csv >> $L
timeout $(cap 90) python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_backward_ring.py -k "training_loop" > $OUT/r/t_loop.txt 2>&1; say loop $?; tail -12 $OUT/r/t_loop.txt >> $L
timeout $(cap 80) python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_experts.py -k "gathered_operands or wgrad" > $OUT/r/t_experts.txt 2>&1; say experts_gpu $?; tail -6 $OUT/r/t_experts.txt >> $L
timeout $(cap 70) python3 benchmarks/wgrad_gather_ab.py --rounds 5 --out $OUT/r/ab.json > $OUT/r/ab.txt 2>&1; say ab $?; grep "^|" $OUT/r/ab.txt >> $L || tail -5 $OUT/r/ab.txt >> $L
MEGAMOE_GATHER_X=1 timeout $(cap 80) python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_backward_ring.py -k "replayed and bf16" > $OUT/r/t_ring_x.txt 2>&1; say ring_gather_x $?; tail -4 $OUT/r/t_ring_x.txt >> $L
for kg in 00 10 11 01 00; do k=${kg:0:1}; g=${kg:1:1}
MEGAMOE_KEYED_POOL=$k MEGAMOE_GATHER_X=$g timeout $(cap 45) python3 -m megamoe bench --ep 1 --impl megamoe --preset sonic-7b --tokens 24576 --passes bwd,step --iters 10 --json $OUT/r/b_$kg.json --md $OUT/r/b_$kg.md > $OUT/r/b_$kg.txt 2>&1; say "bench sonic keyed=$k gather_x=$g" $?; grep -E "^\| (megamoe|nccl)" $OUT/r/b_$kg.md >> $L || tail -4 $OUT/r/b_$kg.txt >> $L
done
(cd $OUT && tar czf r.tgz r && rm -rf r)
grep -v "^\s*$" $L | tail -80
