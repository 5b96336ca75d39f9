export PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p $OUT/r; L=$OUT/log.txt
nvidia-smi --query-gpu=name,power.limit,clocks.sm --format=csv >> $L
t0=$(date +%s)
echo "== gathers/slots tests" >> $L
timeout 200 python3 -m pytest -q -x tests/test_experts.py -k "gathered_operands or by_token or slots" >> $L 2>&1; echo "rc=$? t=$(( $(date +%s)-t0 ))" >> $L
echo "== gpu ws/bias tests" >> $L
timeout 200 python3 -m pytest -q -m gpu tests/test_experts.py tests/test_expert_bias.py tests/test_experts_fp8.py -k "forward_ws_gives or fp8_ws_gives or dact_ws_gives or wgrad_ws or bias" 2>&1 | tail -15 >> $L; echo "t=$(( $(date +%s)-t0 ))" >> $L
echo "== gpu gradients" >> $L
timeout 120 python3 -m pytest -q -m gpu tests/test_training.py -k gpu_gradients 2>&1 | tail -8 >> $L; echo "t=$(( $(date +%s)-t0 ))" >> $L
for p in qwen3-30b-a3b:8192 sonic-7b:24576; do for g in 0 1; do n=${p%%:*}_g$g
  MEGAMOE_GATHER_ON_LOAD=$g timeout 150 python3 -m megamoe bench --ep 1 --impl nccl-torch,megamoe --iters 10 --preset ${p%%:*} --tokens ${p##*:} --passes fwd,bwd,step --json $OUT/r/$n.json --md $OUT/r/$n.md > $OUT/r/$n.txt 2>&1
  echo "== $n rc=$? t=$(( $(date +%s)-t0 ))" >> $L; grep -E "^\|" $OUT/r/$n.md >> $L
  (cd $OUT && tar czf r.tgz r)
done; done
cat $L | tail -80
