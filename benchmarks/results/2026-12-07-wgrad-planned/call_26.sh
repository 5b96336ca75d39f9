# call 26: the static gathering test alone with a per-test timeout (call 25's t_gather0 passed 256-256 and ran past 50 s on 200-136), then the loads call 25 ran out of time for
# (run on call 25's warm machine: its .gpu/both, made there by call 25, did not survive the carry, so the "both" rows ran in .gpu/new with MEGAMOE_WGRAD_PLANNED=1: repeats of new:1)
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
G=$PWD/.gpu; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 560 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
cd $G/new
MEGAMOE_WGRAD_PLANNED=0 timeout $(cap 170) python3 -m pytest -v -m gpu tests/test_experts.py -k "gathered_operands and 200" --timeout 150 -p no:cacheprovider --durations=0 > $OUT/r/t_gather0.txt 2>&1; say t_gather0 $?; grep -E "FAILED|ERROR|passed|failed|Timeout|call " $OUT/r/t_gather0.txt | tail -8 >> $L
K="python3 benchmarks/backward_kernels.py --impl megamoe --rounds 3 --steady 1 --pass bwd"
for load in "--preset deepseek-v3" "--preset sonic-7b --tokens 24576 --routing zipf" "--preset deepseek-v3 --routing zipf"; do
  for s in new:1 both:1 new:0 base:0; do
    IFS=: read t d <<< "$s"; cd $G/$t
    n=bk_${t}${d}_$(echo $load | tr -d ' -' | cut -c1-40)
    MEGAMOE_WGRAD_PLANNED=$d timeout $(cap 45) $K --out /tmp/o_$t$d $load > $OUT/r/$n.txt 2>&1; say "$n" $?; grep -E "wgrad_ws_kernel|between events" $OUT/r/$n.txt >> $L
  done
done
(cd $OUT && tar czf r.tgz r && rm -rf r)
grep -v "^\s*$" $L | tail -60
