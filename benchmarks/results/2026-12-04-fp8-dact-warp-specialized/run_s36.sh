#!/usr/bin/env bash
# GPU batch: Gluon dact bits + A/B, FP8 wgrad knobs A/B. Steps as arguments: tests wgrad192 wgrad384 backward
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv > "$OUT/gpu.txt"
for step in "$@"; do
  start=$(date +%s)
  case $step in
    tests) PYTHONPATH=src:tests timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_experts_fp8_bwd.py tests/test_experts_fp8.py tests/test_experts.py -k gpu 2>&1 | tail -25 > "$OUT/tests.log";;
    wgrad*) e=${step#wgrad}; mkdir -p "$OUT/wgrad_$e"; (cd benchmarks && PYTHONPATH=../src timeout 200 python3 fp8_wgrad_ab.py --experts $e --rounds 5 --out "$OUT/wgrad_$e" 2>&1 | tail -20 > "$OUT/wgrad_$e.log");;
    backward) (cd benchmarks && PYTHONPATH=../src timeout 500 python3 fp8_backward_ab.py --variants plan,triton,gluon-dact,triton-dact --mx-variants plan --rounds 5 --out "$OUT" 2>&1 | tail -30 > "$OUT/backward.log");;
    glm5) PYTHONPATH=src timeout 400 python3 -m megamoe bench --preset glm-5 --tokens 8192 --ep 1 --impl megamoe --experts bf16,fp8-block --passes fwd,bwd,step --iters 5 > "$OUT/glm5.log" 2>&1;;
    vsdense) (cd benchmarks && PYTHONPATH=../src timeout 300 python3 gemm_vs_dense.py --rounds 3 --seconds 0.4 --out "$OUT" 2>&1 | tail -20 > "$OUT/vsdense.log");;
    glm5ab) (cd benchmarks && PYTHONPATH=../src timeout 400 python3 fp8_backward_ab.py --preset glm-5 --experts 256 --variants plan,gluon-dact,triton-dact --mx-variants "" --rounds 5 --out "$OUT/glm5ab" 2>&1 | tail -30 > "$OUT/glm5ab.log");;
    final) PYTHONPATH=src:tests timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_experts_fp8_bwd.py tests/test_experts_fp8.py tests/test_experts.py -k gpu 2>&1 | tail -5 > "$OUT/final.log"
      (cd benchmarks && PYTHONPATH=../src timeout 300 python3 fp8_backward_ab.py --variants plan,triton --mx-variants "" --rounds 5 --out "$OUT/final" 2>&1 | tail -40 >> "$OUT/final.log");;
    ncu) NCU="/usr/local/cuda/bin/ncu --clock-control none --launch-skip 2 --launch-count 1 --set full --import-source no --csv --page details"
      (cd benchmarks
       for e in 16 192; do
         PYTHONPATH=../src timeout 150 $NCU --kernel-name regex:forward_fp8_ws python3 fp8_forward_ab.py --kind gate_up --experts $e --rounds 1 --seconds 0.05 --out /tmp > "$OUT/ncu_fp8_gate_up_$e.csv" 2> "$OUT/ncu_fp8_gate_up_$e.err"
       done
       PYTHONPATH=../src timeout 150 $NCU --kernel-name regex:^forward_ws_kernel python3 forward_ws_ab.py --kind gate_up --experts 16 --variants plan --rounds 1 --seconds 0.05 --out /tmp > "$OUT/ncu_bf16_gate_up_16.csv" 2> "$OUT/ncu_bf16_gate_up_16.err")
      wc -l "$OUT"/ncu_*.csv > "$OUT/ncu.log"; tail -3 "$OUT"/ncu_*.err >> "$OUT/ncu.log";;
    ncusrc) (cd benchmarks
       PYTHONPATH=../src timeout 200 /usr/local/cuda/bin/ncu --clock-control none --launch-skip 2 --launch-count 1 --set full --import-source no --kernel-name regex:forward_fp8_ws -o /tmp/g16 -f python3 fp8_forward_ab.py --kind gate_up --experts 16 --rounds 1 --seconds 0.05 --out /tmp > "$OUT/ncusrc.log" 2>&1
       /usr/local/cuda/bin/ncu -i /tmp/g16.ncu-rep --page raw --csv > "$OUT/ncu_raw_fp8_gate_up_16.csv" 2>> "$OUT/ncusrc.log"
       /usr/local/cuda/bin/ncu -i /tmp/g16.ncu-rep --page source --csv --print-source sass > "$OUT/ncu_sass_fp8_gate_up_16.csv" 2>> "$OUT/ncusrc.log"
       ls -la /tmp/g16.ncu-rep >> "$OUT/ncusrc.log"; wc -l "$OUT"/ncu_*.csv >> "$OUT/ncusrc.log");;
  esac
  echo "== $step $(( $(date +%s) - start )) s"; tail -12 "$OUT"/${step/wgrad/wgrad_}.log 2>/dev/null
done
