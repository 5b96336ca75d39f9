# A1: today's kernel change (wgrad gather index prefetch) correctness + soak barrier fix + wgrad gather A/B old vs new
export PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd .gpu; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 560 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
nvidia-smi --query-gpu=name,power.limit,clocks.sm,memory.total --format=csv >> $L
timeout $(cap 90) python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_experts.py -k "gathered_operands or wgrad" > $OUT/r/t_experts.txt 2>&1; say experts_gpu $?; tail -3 $OUT/r/t_experts.txt >> $L
MEGAMOE_GATHER_BACKWARD=1 timeout $(cap 90) python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_backward_ring.py -k "replayed and bf16" > $OUT/r/t_ring.txt 2>&1; say ring_gather $?; tail -3 $OUT/r/t_ring.txt >> $L
timeout $(cap 100) python3 benchmarks/wgrad_gather_ab.py --rounds 5 --out $OUT/r/ab_new.json > $OUT/r/ab_new.txt 2>&1; say ab_new $?; tail -14 $OUT/r/ab_new.txt >> $L
(cd old && PYTHONPATH=src timeout $(cap 100) python3 ../benchmarks/wgrad_gather_ab.py --rounds 5 --out $OUT/r/ab_old.json > $OUT/r/ab_old.txt 2>&1); say ab_old $?; tail -14 $OUT/r/ab_old.txt >> $L
MEGAMOE_SOAK_GPU_PASSES=48 timeout $(cap 150) python3 -m pytest -q -m gpu -x -p no:cacheprovider tests/test_soak.py > $OUT/r/soak.txt 2>&1; say soak $?; tail -3 $OUT/r/soak.txt >> $L
(cd $OUT && tar czf r.tgz r && rm -rf r)
grep -v "^\s*$" $L | tail -60
