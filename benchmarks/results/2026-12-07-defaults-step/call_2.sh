# call 2: where the mxfp8 step's time goes at today's defaults (qwen3-30b-a3b, per kernel); on an H200 kimi-k2's BF16 backward per kernel and glm-5's bf16 / fp8-block step, else qwen3-30b-a3b's fp8-block step and deepseek-v3's fp8-block backward per kernel; SonicMoE's sonic-7b shape in tiles_ab
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd .gpu; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 565 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
nvidia-smi --query-gpu=name,power.limit,clocks.sm,memory.total --format=csv >> $L
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
K="python3 benchmarks/backward_kernels.py --impl megamoe --out $OUT/r --rounds 3 --steady 1"
bk() { local name=$1 c=$2; shift 2; timeout $(cap $c) $K "$@" > $OUT/r/$name.txt 2>&1; say "$name" $?; tail -28 $OUT/r/$name.txt >> $L; }
bk bk_q_mx 90 --preset qwen3-30b-a3b --pass step --experts mxfp8
if [ "$MEM" -gt 100000 ]; then
  bk bk_kimi 170 --preset kimi-k2 --pass bwd
  B="python3 -m megamoe bench --ep 1 --impl megamoe --tokens 8192 --passes fwd,bwd,step --iters 5 --steady 1"
  timeout $(cap 150) $B --experts bf16,fp8-block --preset glm-5 --json $OUT/r/glm5.json --md $OUT/r/glm5.md > $OUT/r/glm5.txt 2>&1; say glm5 $?; grep -E "^\| (megamoe|nccl)" $OUT/r/glm5.md >> $L 2>/dev/null || tail -3 $OUT/r/glm5.txt >> $L
else
  bk bk_q_fp8 80 --preset qwen3-30b-a3b --pass step --experts fp8-block
  bk bk_dsv3_fp8 140 --preset deepseek-v3 --pass bwd --experts fp8-block
fi
timeout $(cap 100) python3 benchmarks/tiles_ab.py --preset sonic-7b --tokens 24576 --experts 128 > $OUT/r/tiles_sonic7b.txt 2>&1; say tiles_sonic7b $?; tail -14 $OUT/r/tiles_sonic7b.txt >> $L
(cd $OUT && tar czf r.tgz r && rm -rf r)
grep -v "^\s*$" $L | tail -120
