# call 12: what bounds the static BF16 wgrad at few rows an expert (deepseek-v3: 256 rows, ~400 TFLOP/s on one H100) against many (qwen3-30b-a3b at 16384 tokens: 1024 rows, ~515): ncu's full set on one wgrad_ws_kernel launch of each load (gemm_vs_dense.py's expert backward), at the power cap's clocks (--clock-control none); the speed-of-light, memory and compute tables kept
export PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd .gpu; mkdir -p $OUT/r; L=$OUT/log.txt
nvidia-smi --query-gpu=name,power.limit,clocks.sm,memory.total --format=csv >> $L
NCU="/usr/local/cuda/bin/ncu --clock-control none --launch-skip 2 --launch-count 1 --set full --import-source no --csv --page details --kernel-name regex:wgrad_ws_kernel"
for load in "deepseek-v3 8192 256" "qwen3-30b-a3b 16384 128"; do
  set -- $load; n=ncu_$1_$3
  (cd benchmarks && PYTHONPATH=../src timeout 200 $NCU python3 gemm_vs_dense.py --preset $1 --tokens $2 --experts $3 --rounds 1 --seconds 0.05 --out /tmp > $OUT/r/$n.csv 2> $OUT/r/$n.err); echo "== $n rc=$?" >> $L
  grep -E '"(Duration|DRAM Throughput|L2 Cache Throughput|L1/TEX Cache Throughput|Compute \(SM\) Throughput|Memory Throughput|Registers Per Thread|Achieved Occupancy)"' $OUT/r/$n.csv | cut -d, -f12-16 >> $L
done
(cd $OUT && tar czf r.tgz r && rm -rf r)
cat $L
