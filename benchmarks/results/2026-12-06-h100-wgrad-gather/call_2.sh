# A2: step with the backward gathering on load (0/1) at sonic-7b / qwen3; per-kernel step for bf16 / mxfp8 / fp8-block at qwen3
export PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd .gpu; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 565 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
nvidia-smi --query-gpu=name,power.limit,clocks.sm,memory.total --format=csv >> $L
for p in sonic-7b:24576 qwen3-30b-a3b:8192; do for g in 0 1; do
MEGAMOE_GATHER_BACKWARD=$g timeout $(cap 70) python3 -m megamoe bench --ep 1 --impl megamoe --preset ${p%%:*} --tokens ${p##*:} --passes fwd,bwd,step --iters 10 --json $OUT/r/b_${p%%:*}_g$g.json --md $OUT/r/b_${p%%:*}_g$g.md > $OUT/r/b_${p%%:*}_g$g.txt 2>&1; say "bench $p gather=$g" $?; grep -E "^\| (megamoe|nccl)" $OUT/r/b_${p%%:*}_g$g.md >> $L || tail -4 $OUT/r/b_${p%%:*}_g$g.txt >> $L
done; done
for e in mxfp8 fp8-block bf16; do
timeout $(cap 75) python3 benchmarks/backward_kernels.py --preset qwen3-30b-a3b --tokens 8192 --impl megamoe --experts $e --pass step --steady 2 --rounds 3 --top 16 --out $OUT/r/k_$e > $OUT/r/k_$e.txt 2>&1; say "kernels $e" $?; tail -22 $OUT/r/k_$e.txt >> $L
done
rm -f $OUT/r/*/*.json.gz; (cd $OUT && tar czf r.tgz r && rm -rf r)
grep -v "^\s*$" $L | tail -100
