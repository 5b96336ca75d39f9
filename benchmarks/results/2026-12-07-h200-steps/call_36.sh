# call 36 (any Hopper; .gpu/new = git archive HEAD src tests pyproject.toml benchmarks): why deepseek-v3's dx and dact
# run 16-19 % slower under zipf than uniform at 8192 tokens (the tiles' counts differ by 2 %: 657 against 641; the
# experts' weight reads by 11 %: 285 against 256 at GROUP_M 8; 181 experts hold one tile under zipf). ncu on one dx and
# one dact launch of each routing: duration, DRAM bytes and throughput, L2 hit rate, SM throughput, the stall mix
export MEGAMOE_COMMIT=$(cat $PWD/.gpu/COMMIT 2>/dev/null) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd .gpu/new; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 540 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
for r in zipf uniform; do
  for k in dx_kernel dact_ws_kernel; do
    n=ncu_${r}_$k
    timeout $(cap 120) /usr/local/cuda/bin/ncu --clock-control none --launch-skip 1 --launch-count 1 --set full -o $OUT/r/$n --kernel-name regex:$k python3 benchmarks/backward_kernels.py --impl megamoe --rounds 1 --steady 1 --pass bwd --preset deepseek-v3 --tokens 8192 --routing $r --out /tmp/o_$n > $OUT/r/$n.txt 2>&1; say $n $?
    timeout 30 /usr/local/cuda/bin/ncu -i $OUT/r/$n.ncu-rep --page details --csv > $OUT/r/$n.details.csv 2>/dev/null; grep -E '"Duration"|"DRAM Throughput"|"L2 Hit Rate"|"Compute \(SM\) Throughput"|"Memory Throughput"' $OUT/r/$n.details.csv | cut -d, -f12-16 >> $L
  done
done
(cd $OUT && tar czf r.tgz r && rm -rf r)
grep -v "^\s*$" $L | tail -40
