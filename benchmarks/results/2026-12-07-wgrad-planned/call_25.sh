# call 25 (next GPU session; .gpu/new = this tree, .gpu/base = git archive f1716b2): the plan with its producer's entries two blocks ahead, its first rows' indices one, and each new expert's descriptors at the other site (new), the same with the static deal's blocks a program (both: the deal in expert order, no snake; made here by two seds, never committed), the first plan (base, two regions, entries loaded as it came to them) and the static deal with its first rows' indices once an expert (new:0) or once a block (base:0); GPU bits first
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
G=$PWD/.gpu; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 560 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
nvidia-smi --query-gpu=name,power.limit,clocks.sm,memory.total --format=csv >> $L
rm -rf $G/both && cp -r $G/new $G/both
sed -i 's/return tl.where(active, rows, -1), rows, active/return tl.where(active, 0, -1), rows, active/' $G/both/src/megamoe/kernels/wgrad_deal.py  # every computed expert as heavy: expert order
sed -i 's/pos = k \* NUM_PROGRAMS + p + (k % 2) \* (NUM_PROGRAMS - 1 - 2 \* p)/pos = k * NUM_PROGRAMS + p/' $G/both/src/megamoe/kernels/wgrad_planned.py
(cd $G; diff -r new both | grep '^[<>]') >> $L
cd $G/new
timeout $(cap 90) python3 -m pytest -v -m gpu tests/test_experts.py -k "wgrad_ws" -p no:cacheprovider > $OUT/r/t_wgrad.txt 2>&1; say t_wgrad $?; grep -E "FAILED|ERROR|passed|failed" $OUT/r/t_wgrad.txt | tail -6 >> $L
for d in 0 1; do  # the gathering producers, static (first rows once an expert) and planned
  MEGAMOE_WGRAD_PLANNED=$d timeout $(cap 50) python3 -m pytest -v -m gpu tests/test_experts.py -k "gathered_operands" -p no:cacheprovider > $OUT/r/t_gather$d.txt 2>&1; say t_gather$d $?; grep -E "FAILED|ERROR|passed|failed" $OUT/r/t_gather$d.txt | tail -4 >> $L
done
K="python3 benchmarks/backward_kernels.py --impl megamoe --rounds 3 --steady 1 --pass bwd"
for load in "--preset deepseek-v3" "--preset qwen3-30b-a3b --tokens 16384" "--preset qwen3-30b-a3b --tokens 16384 --routing zipf" "--preset deepseek-v3 --routing zipf" "--preset sonic-7b --tokens 24576 --routing zipf"; do
  for s in new:1 both:1 base:1 new:0 base:0; do
    IFS=: read t d <<< "$s"; cd $G/$t
    n=bk_${t}${d}_$(echo $load | tr -d ' -' | cut -c1-40)
    MEGAMOE_WGRAD_PLANNED=$d timeout $(cap 35) $K --out /tmp/o_$t$d $load > $OUT/r/$n.txt 2>&1; say "$n" $?; grep -E "wgrad_ws_kernel|between events" $OUT/r/$n.txt >> $L
  done
done
(cd $OUT && tar czf r.tgz r && rm -rf r)
grep -v "^\s*$" $L | tail -60
