# call 27 (1820791): the skew-selected plan. GPU bits (wgrad_ws incl. every plan skew, gathered operands, carry), then a
# zipf exponent sweep (the bench's popularity rank^-A, A from ZIPF_A; edited on the device only) with the plan (skew 0)
# and the static deal (skew inf), then the default (skew 3: both launches, one a no-op) on uniform and zipf loads
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
G=$PWD/.gpu; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 560 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
nvidia-smi --query-gpu=name,power.limit,clocks.sm,memory.total --format=csv >> $L
cd $G/new
sed -i 's/pow(-1.2)/pow(-float(__import__("os").environ.get("ZIPF_A", "1.2")))/' src/megamoe/bench/problem.py
grep -c ZIPF_A src/megamoe/bench/problem.py >> $L
timeout $(cap 170) python3 -m pytest -v -m gpu tests/test_experts.py -k "wgrad_ws or gathered_operands" --timeout 150 -p no:cacheprovider > $OUT/r/t_bits.txt 2>&1; say t_bits $?; grep -E "FAILED|ERROR|passed|failed" $OUT/r/t_bits.txt | tail -8 >> $L
K="python3 benchmarks/backward_kernels.py --impl megamoe --rounds 3 --steady 1 --pass bwd"
run() { n=bk_$1_$(echo $2 | tr -d ' -' | cut -c1-40); shift; MEGAMOE_WGRAD_PLAN_SKEW=$S ZIPF_A=$A timeout $(cap 40) $K --out /tmp/o $@ > $OUT/r/$n.txt 2>&1; say "$n" $?; grep -E "wgrad_ws_kernel" $OUT/r/$n.txt >> $L; }
for A in 0.2 0.35 0.5; do for S in 0 inf; do run "s${S}_a$A" "--preset qwen3-30b-a3b --tokens 16384 --routing zipf"; done; done
A=0.35; for S in 0 inf; do run "s${S}_a$A" "--preset deepseek-v3 --routing zipf"; done
A=1.2; for S in 3 inf 0; do run "s${S}" "--preset qwen3-30b-a3b --tokens 16384"; run "s${S}z" "--preset qwen3-30b-a3b --tokens 16384 --routing zipf"; done
(cd $OUT && tar czf r.tgz r && rm -rf r)
grep -v "^\s*$" $L | tail -60
