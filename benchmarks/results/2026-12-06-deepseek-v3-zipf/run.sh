export PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd .gpu
L=$OUT/log.txt; t0=$(date +%s); mkdir -p $OUT/r
left() { echo $(( $1 - ($(date +%s)-t0) )); }
nvidia-smi --query-gpu=name,power.limit,clocks.sm --format=csv >> $L
timeout $(left 130) python3 benchmarks/backward_kernels.py --preset qwen3-30b-a3b --tokens 8192 --impl nccl-torch,megamoe --pass step --routing zipf --out $OUT/r > $OUT/r/zipf.txt 2>&1; echo "== zipf rc=$? t=$(( $(date +%s)-t0 ))" >> $L
timeout $(left 230) python3 benchmarks/backward_kernels.py --preset qwen3-30b-a3b --tokens 8192 --impl nccl-torch,megamoe --pass step --out $OUT/r > $OUT/r/uni.txt 2>&1; echo "== uni rc=$? t=$(( $(date +%s)-t0 ))" >> $L
timeout $(left 540) python3 -m megamoe bench --ep 1 --impl nccl-torch,megamoe --preset deepseek-v3 --tokens 8192 --passes fwd,bwd,step --iters 5 --steady 1 --json $OUT/r/dsv3.json --md $OUT/r/dsv3.md > $OUT/r/dsv3.txt 2>&1; echo "== dsv3 rc=$? t=$(( $(date +%s)-t0 ))" >> $L; grep -E "^\|" $OUT/r/dsv3.md >> $L
tail -5 $OUT/r/dsv3.txt >> $L
rm -f $OUT/r/*.json.gz
(cd $OUT && tar czf r.tgz r && rm -rf r)
grep -v "^\s*$" $L | tail -40
