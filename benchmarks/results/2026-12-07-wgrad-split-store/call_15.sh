# call 15: what bounds deepseek-v3's dact (5.1 ms with the shared expert's, ~420 TFLOP/s: its K loop of 7168 and its SwiGLU' epilogue) and dx (7.5 ms, ~580 TFLOP/s) in the backward: ncu's full set on one launch of each (gemm_vs_dense.py's expert backward at 256 x 256 rows), clocks uncontrolled (the power cap's)
export PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd .gpu; mkdir -p $OUT/r; L=$OUT/log.txt
nvidia-smi --query-gpu=name,power.limit,clocks.sm,memory.total --format=csv >> $L
for k in dact_ws_kernel dx_kernel; do
  n=ncu_dsv3_$k
  (cd benchmarks && PYTHONPATH=../src timeout 200 /usr/local/cuda/bin/ncu --clock-control none --launch-skip 1 --launch-count 1 --set full --import-source no --csv --page details --kernel-name regex:$k python3 gemm_vs_dense.py --preset deepseek-v3 --tokens 8192 --experts 256 --rounds 1 --seconds 0.05 --out /tmp > $OUT/r/$n.csv 2> $OUT/r/$n.err); echo "== $n rc=$?" >> $L
  python3 - $OUT/r/$n.csv >> $L <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 14]
if rows:
    h = rows[0]; sec, name, val = h.index("Section Name"), h.index("Metric Name"), h.index("Metric Value")
    keep = ("Duration", "SM Frequency", "Compute (SM) Throughput", "DRAM Throughput", "L2 Cache Throughput",
            "L2 Hit Rate", "Registers Per Thread", "Dynamic Shared Memory Per Block", "Issue Slots Busy")
    for r in rows[1:]:
        if r[name] in keep:
            print(f"  {r[name]} = {r[val]}")
        elif r[sec] == "WarpStateStats" and len(r) > val + 3:
            print("  rule:", r[val + 3][:220])
PY
done
(cd $OUT && tar czf r.tgz r && rm -rf r)
cat $L
