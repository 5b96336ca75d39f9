# call 19: the split store under zipf routing and at gpt-oss-120b again (adopt-or-not), then ncu's source view of the Gluon wgrad's deals (static and counter-dealt) at deepseek-v3's uniform down wgrad: where the counter deal's per-block cost sits
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd .gpu; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 440 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
nvidia-smi --query-gpu=name,power.limit,clocks.sm,memory.total --format=csv >> $L
K="python3 benchmarks/backward_kernels.py --impl megamoe --rounds 3 --steady 1 --pass bwd"
for load in "--preset gpt-oss-120b --tokens 8192" "--preset qwen3-30b-a3b --tokens 16384 --routing zipf" "--preset deepseek-v3 --routing zipf"; do
  for s in 1 0; do
    mkdir -p $OUT/r/s$s; n=bk_s${s}_$(echo $load | tr -d ' -' | cut -c1-40)
    MEGAMOE_WGRAD_SPLIT_STORE=$s timeout $(cap 45) $K --out $OUT/r/s$s $load > $OUT/r/$n.txt 2>&1; say "$n" $?; grep -E "wgrad_ws_kernel|between events" $OUT/r/$n.txt >> $L
  done
done
for d in 1 0; do
  n=ncu_wgrad_dyn$d
  (cd benchmarks && MEGAMOE_WGRAD_DYNAMIC=$d PYTHONPATH=../src timeout $(cap 120) /usr/local/cuda/bin/ncu --clock-control none --launch-skip 1 --launch-count 1 --set full --import-source yes -o $OUT/r/$n --kernel-name regex:wgrad_ws_kernel python3 gemm_vs_dense.py --preset deepseek-v3 --tokens 8192 --experts 256 --rounds 1 --seconds 0.05 --out /tmp > $OUT/r/$n.txt 2>&1); say $n $?
  timeout 60 /usr/local/cuda/bin/ncu -i $OUT/r/$n.ncu-rep --page source --csv --print-source sass > $OUT/r/$n.sass.csv 2> $OUT/r/$n.sass.err; say ${n}_src $?
  timeout 30 /usr/local/cuda/bin/ncu -i $OUT/r/$n.ncu-rep --page details --csv > $OUT/r/$n.details.csv 2>/dev/null; grep -E '"Duration"|"SM Frequency"|"DRAM Throughput"|"Compute \(SM\) Throughput"' $OUT/r/$n.details.csv | cut -d, -f12-16 >> $L
done
ls -la $OUT/r >> $L
(cd $OUT && tar czf r.tgz r && rm -rf r)
grep -v "^\s*$" $L | tail -40
