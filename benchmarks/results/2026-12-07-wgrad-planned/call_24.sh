# call 24: ncu on the layer's wgrads at deepseek-v3 8192 uniform (where the one-region plan lost 24 %), one-region planned and static: per-block stalls in the source view
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd .gpu/new; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 420 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
for d in 1 0; do
  n=ncu_layer_planned$d
  MEGAMOE_WGRAD_PLANNED=$d timeout $(cap 180) /usr/local/cuda/bin/ncu --clock-control none --launch-skip 1 --launch-count 1 --set full --import-source yes -o $OUT/r/$n --kernel-name regex:wgrad_ws_kernel python3 benchmarks/backward_kernels.py --impl megamoe --rounds 1 --steady 1 --pass bwd --preset deepseek-v3 --out /tmp/o$d > $OUT/r/$n.txt 2>&1; say $n $?
  timeout 60 /usr/local/cuda/bin/ncu -i $OUT/r/$n.ncu-rep --page source --csv --print-source sass > $OUT/r/$n.sass.csv 2> $OUT/r/$n.sass.err; say ${n}_src $?
  timeout 30 /usr/local/cuda/bin/ncu -i $OUT/r/$n.ncu-rep --page details --csv > $OUT/r/$n.details.csv 2>/dev/null; grep -E '"Duration"|"DRAM Throughput"|"L2 Hit Rate"|"Compute \(SM\) Throughput"' $OUT/r/$n.details.csv | cut -d, -f12-16 >> $L
done
(cd $OUT && tar czf r.tgz r && rm -rf r)
grep -v "^\s*$" $L | tail -40
