export PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd .gpu
L=$OUT/log.txt; t0=$(date +%s); mkdir -p $OUT/r
left() { echo $(( $1 - ($(date +%s)-t0) )); }
nvidia-smi --query-gpu=name,power.limit,clocks.sm --format=csv >> $L
git -C .. log -1 --format=%h >> $L 2>/dev/null
timeout $(left 170) python3 -m pytest -q -m gpu -x -p no:cacheprovider tests/test_expert_bias.py tests/test_bench_harness.py tests/test_experts.py -k "bias or parked or gathered_operands or ws_gives" > $OUT/r/tests.txt 2>&1; echo "== tests rc=$? t=$(( $(date +%s)-t0 ))" >> $L; tail -4 $OUT/r/tests.txt >> $L
B="python3 -m megamoe bench --ep 1 --impl megamoe --preset qwen3-30b-a3b --tokens 8192 --passes fwd,bwd,step --iters 5 --steady 1"
MEGAMOE_MXFP8_AS_BF16=1 timeout $(left 310) $B --experts bf16,mxfp8 --json $OUT/r/mx1.json --md $OUT/r/mx1.md > $OUT/r/mx1.txt 2>&1; echo "== mx1 rc=$? t=$(( $(date +%s)-t0 ))" >> $L; grep -E "^\|" $OUT/r/mx1.md >> $L
G="python3 -m megamoe bench --ep 1 --impl nccl-torch,megamoe --preset qwen3-30b-a3b --tokens 8192 --passes step --iters 5 --steady 1"
MEGAMOE_GATHER_ON_LOAD=1 timeout $(left 420) $G --json $OUT/r/g1.json --md $OUT/r/g1.md > $OUT/r/g1.txt 2>&1; echo "== g1 rc=$? t=$(( $(date +%s)-t0 ))" >> $L; grep -E "^\|" $OUT/r/g1.md >> $L
MEGAMOE_GATHER_ON_LOAD=0 timeout $(left 500) $G --json $OUT/r/g0.json --md $OUT/r/g0.md > $OUT/r/g0.txt 2>&1; echo "== g0 rc=$? t=$(( $(date +%s)-t0 ))" >> $L; grep -E "^\|" $OUT/r/g0.md >> $L
MEGAMOE_MXFP8_AS_BF16=0 timeout $(left 570) $B --experts mxfp8 --passes step --json $OUT/r/mx0.json --md $OUT/r/mx0.md > $OUT/r/mx0.txt 2>&1; echo "== mx0 rc=$? t=$(( $(date +%s)-t0 ))" >> $L; grep -E "^\|" $OUT/r/mx0.md >> $L
tail -3 $OUT/r/mx1.txt $OUT/r/g1.txt >> $L
(cd $OUT && tar czf r.tgz r && rm -rf r)
grep -v "^\s*$" $L | tail -60
