# call 38 (.gpu/new = git archive HEAD src tests pyproject.toml benchmarks): on an H200 kimi-k2's BF16 step beside
# nccl-torch (issue 49: step >= 1.5x, backward <= 26.5 ms), kimi-k2's fp8-block step alone in its process and
# deepseek-v3's fp8-block beside BF16 (issue 50: >= 1.4x). On an H100: qwen3-30b-a3b's mxfp8 step beside BF16 (issue
# 50: >= 0.9x; the E4M3 ring's zero fill gone) and ncu on deepseek-v3's routed dx and dact (zipf, uniform; four
# launches each, the routed ones the long ones)
export MEGAMOE_COMMIT=$(cat $PWD/.gpu/COMMIT 2>/dev/null) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITON_CACHE_DIR=$PWD/.tcache
cd .gpu/new; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 560 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
nvidia-smi --query-gpu=name,power.limit,clocks.sm,memory.total --format=csv >> $L
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
B="python3 -m megamoe bench --ep 1 --passes fwd,bwd,step --iters 5 --steady 1 --tokens 8192"
run() { local name=$1 c=$2; shift 2; timeout $(cap $c) "$@" --json $OUT/r/$name.json --md $OUT/r/$name.md > $OUT/r/$name.txt 2>&1; say "$name" $?; grep -E "^\| (megamoe|nccl)" $OUT/r/$name.md >> $L 2>/dev/null || tail -3 $OUT/r/$name.txt >> $L; }
if [ "$MEM" -gt 100000 ]; then
  run kimi_bf16 190 $B --impl nccl-torch,megamoe --experts bf16 --preset kimi-k2
  run kimi_fp8 150 $B --impl megamoe --experts fp8-block --preset kimi-k2
  run d8_fp8 170 $B --impl megamoe --experts bf16,fp8-block --preset deepseek-v3
else
  run q8_mx 120 $B --impl megamoe --experts bf16,mxfp8 --preset qwen3-30b-a3b
  for r in zipf uniform; do
    for k in dx_kernel dact_ws_kernel; do
      n=ncu_${r}_$k
      timeout $(cap 100) /usr/local/cuda/bin/ncu --clock-control none --launch-count 4 --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats -o $OUT/r/$n --kernel-name regex:$k python3 benchmarks/backward_kernels.py --impl megamoe --rounds 1 --steady 0 --pass bwd --preset deepseek-v3 --tokens 8192 --routing $r --out /tmp/o_$n > $OUT/r/$n.txt 2>&1; say $n $?
      timeout 30 /usr/local/cuda/bin/ncu -i $OUT/r/$n.ncu-rep --page details --csv > $OUT/r/$n.details.csv 2>/dev/null
      python3 -c "import csv,sys; [print(sys.argv[2], r[0], r[12], r[14]) for r in csv.reader(open(sys.argv[1])) if r[12] in ('Duration','DRAM Throughput','L2 Hit Rate','Compute (SM) Throughput')]" $OUT/r/$n.details.csv $n >> $L 2>&1
    done
  done
fi
(cd $OUT && tar czf r.tgz r && rm -rf r)
grep -v "^\s*$" $L | tail -40
