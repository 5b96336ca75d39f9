# Next GPU session (tree = HEAD via git archive into .gpu; carry [".gpu"]; run from repo root: bash .gpu/next.sh)
export PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd .gpu; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
left() { echo $(( $1 - ($(date +%s)-t0) )); }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
nvidia-smi --query-gpu=name,power.limit,clocks.sm --format=csv >> $L
# 5. kimi-k2 at EP 1 (bf16 1.5x target; fp8-block step 1.4x BF16's, issue 50)
P=kimi-k2; nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | awk '{exit !($1<100000)}' && P=deepseek-v3
timeout $(left 330) python3 -m megamoe bench --ep 1 --impl nccl-torch,megamoe --experts bf16,fp8-block --preset $P --tokens 8192 --passes fwd,bwd,step --iters 5 --steady 1 --json $OUT/r/kimi.json --md $OUT/r/kimi.md > $OUT/r/kimi.txt 2>&1; say kimi $?; grep -E "^\|" $OUT/r/kimi.md >> $L
mkdir -p $OUT/r/fp8x; timeout $(left 500) python3 benchmarks/backward_kernels.py --preset $P --tokens 8192 --impl megamoe --experts fp8-block --pass bwd --steady 1 --rounds 3 --out $OUT/r/fp8x > $OUT/r/fp8.txt 2>&1; say fp8kernels $?; true
mkdir -p $OUT/r/fp8x; rm -f $OUT/r/fp8x/*.json.gz; (cd $OUT && tar czf r.tgz r && rm -rf r)
grep -v "^\s*$" $L | tail -40
