# ---- out/run_s37.sh (run 1)
#!/bin/bash
# issue 28: the forward megakernel's tiles per compute SM (BF16 and FP8-block) against today's standalone tiles
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ROOT=$(pwd)
git log -1 --format=%h > $OUT/tree.txt 2>/dev/null || true
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm,driver_version --format=csv > $OUT/gpu.txt
for p in bf16 fp8-block; do
  PYTHONPATH=src timeout 240 python3 -m megamoe trace --preset kimi-k2 --tokens 16384 --precision $p --passes 20 \
    --out /tmp/trace_$p > $OUT/trace_$p.log 2>&1; echo "trace $p rc=$?" >> $OUT/steps.txt
done
cp /tmp/trace_fp8-block/trace_record.json.gz $OUT/trace_record_fp8-block_16384.json.gz 2>/dev/null
cd benchmarks
PYTHONPATH=../src timeout 300 python3 gemm_vs_dense.py --experts 384 --tokens 16384 --rounds 3 --seconds 0.3 \
  --out /tmp/gvd > $OUT/gvd_16384.log 2>&1; echo "gvd rc=$?" >> $OUT/steps.txt
cp /tmp/gvd/gemm_vs_dense.json $OUT/gemm_vs_dense_16384.json 2>/dev/null
for k in gate_up down; do
  PYTHONPATH=../src timeout 150 python3 fp8_forward_ab.py --kind $k --experts 384 --tokens 16384 --rounds 3 \
    --seconds 0.3 > $OUT/fp8_ab_$k.log 2>&1; echo "fp8ab $k rc=$?" >> $OUT/steps.txt
done
cat $OUT/steps.txt; grep -h "role compute" $OUT/trace_*.log; grep -h "gate/up\|down" $OUT/gvd_16384.log | head -30; tail -8 $OUT/fp8_ab_*.log
# ---- out/run_s38.sh (run 2)
#!/bin/bash
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd benchmarks
for p in bf16 fp8-block; do
  PYTHONPATH=../src timeout 260 python3 megakernel_per_sm.py --precision $p --tokens 16384 --rounds 3 --seconds 0.4 \
    > $OUT/per_sm_$p.log 2>&1; echo "per_sm $p rc=$?" >> $OUT/steps.txt
done
cat $OUT/steps.txt; tail -12 $OUT/per_sm_*.log
# ---- out/run_s39.sh (run 3)
#!/bin/bash
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader -lms 100 > $OUT/smi.csv &
SMI=$!
for i in 1 2; do
  for t in new old; do
    src=src; [ $t = old ] && src=out/old/src
    echo "$(date +%s.%N) trace $t $i" >> $OUT/phases.txt
    PYTHONPATH=$src timeout 150 python3 -m megamoe trace --tokens 16384 --passes 40 --out /tmp/tr_${t}_$i > /tmp/tr_${t}_$i.log 2>&1
    echo "$t $i rc=$? $(grep 'role compute' /tmp/tr_${t}_$i.log)" >> $OUT/trace_ab.txt
    echo "$(date +%s.%N) done" >> $OUT/phases.txt
  done
done
cp /tmp/tr_new_2/trace_record.json.gz $OUT/trace_record_bf16_new.json.gz
cp /tmp/tr_old_2/trace_record.json.gz $OUT/trace_record_bf16_old.json.gz
cd benchmarks
PYTHONPATH=../src timeout 200 python3 megakernel_per_sm.py --precision bf16 --rounds 3 --seconds 0.4 > $OUT/per_sm_bf16.log 2>&1
kill $SMI
cat $OUT/trace_ab.txt; tail -n 6 $OUT/per_sm_bf16.log
# ---- out/run_s40.sh (run 4)
#!/bin/bash
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader -lms 50 > $OUT/smi.csv &
SMI=$!
cd benchmarks
for p in fp8-block bf16; do
PYTHONPATH=../src timeout 220 python3 megakernel_per_sm.py --precision $p --rounds 4 --seconds 0.5 > $OUT/per_sm_$p.log 2>&1
done
kill $SMI
tail -n 7 $OUT/per_sm_*.log
# ---- out/run_s41.sh (run 5)
#!/bin/bash
# ncu: the BF16 forward megakernel (EP 1, kimi-k2 16384 tokens) against the Triton gate_up / down kernels it inlines
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NCU="/usr/local/cuda/bin/ncu --clock-control none --launch-skip 1 --launch-count 1 --set full --import-source no --csv --page details"
cd benchmarks
for k in megakernel gate_up_kernel down_kernel; do
  PYTHONPATH=../src timeout 170 $NCU --kernel-name regex:^$k python3 megakernel_per_sm.py --precision bf16 --rounds 1 --seconds 0.05 --out /tmp \
    > $OUT/ncu_$k.csv 2> $OUT/ncu_$k.err
  echo "$k rc=$? $(wc -l < $OUT/ncu_$k.csv)" >> $OUT/steps.txt
done
cat $OUT/steps.txt
for k in megakernel gate_up_kernel down_kernel; do
  grep -E '"(Duration|SM Frequency|Compute \(SM\) Throughput|Memory Throughput|L2 Hit Rate|DRAM Throughput|Registers Per Thread|Stall No Instruction|No Instruction)"' $OUT/ncu_$k.csv | cut -c1-20 --complement | head -12
done
# ---- out/run_s42.sh (run 6)
#!/bin/bash
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NCU="/usr/local/cuda/bin/ncu --clock-control none --launch-skip 1 --launch-count 1 --set full --import-source no"
ROOT=$(pwd)
cd benchmarks
for k in megakernel gate_up_kernel; do
  PYTHONPATH=../src timeout 200 $NCU --kernel-name regex:^$k -o /tmp/$k -f python3 megakernel_per_sm.py --precision bf16 --rounds 1 --seconds 0.05 --out /tmp > $OUT/ncu_$k.log 2>&1
  timeout 120 python3 $ROOT/out/ncu_summary.py /tmp/$k.ncu-rep $k > $OUT/sass_$k.txt 2>&1
  /usr/local/cuda/bin/ncu -i /tmp/$k.ncu-rep --page source --csv --print-source sass > /tmp/src_$k.csv 2>/dev/null
  gzip -c /tmp/src_$k.csv > $OUT/src_$k.csv.gz
done
ls -la $OUT; head -30 $OUT/sass_*.txt
# ---- out/run_s43.sh (run 7)
#!/bin/bash
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv,noheader -lms 50 > $OUT/smi.csv &
SMI=$!
cd benchmarks
for p in bf16 fp8-block; do
PYTHONPATH=../src timeout 250 python3 megakernel_per_sm.py --precision $p --stages 3,4 --rounds 4 --seconds 0.4 > $OUT/stages_$p.log 2>&1
done
kill $SMI
tail -n 12 $OUT/stages_*.log
# ---- out/run_s44.sh (run 8)
#!/bin/bash
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PYTHONPATH=src:tests timeout 280 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_megakernel.py tests/test_layer_kernels.py > $OUT/pytest_gpu.log 2>&1
echo "pytest rc=$?" >> $OUT/steps.txt
cd benchmarks
PYTHONPATH=../src timeout 200 python3 megakernel_per_sm.py --precision bf16 --tokens 8192 --stages 3,4 --rounds 4 --seconds 0.4 > $OUT/stages_bf16_8192.log 2>&1
echo "ab rc=$?" >> $OUT/steps.txt
cat $OUT/steps.txt; tail -n 4 $OUT/pytest_gpu.log; tail -n 8 $OUT/stages_bf16_8192.log
# ---- out/run_s45.sh (run 9)
#!/bin/bash
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd benchmarks
PYTHONPATH=../src timeout 150 python3 megakernel_per_sm.py --precision bf16 --tokens 8192 --experts 192 --stages 3,4 --rounds 4 --seconds 0.4 > $OUT/stages_bf16_8192_192.log 2>&1
PYTHONPATH=../src timeout 200 python3 megakernel_per_sm.py --precision bf16 --tokens 16384 --stages 3,4 --rounds 4 --seconds 0.4 > $OUT/stages_bf16_16384_rep.log 2>&1
PYTHONPATH=../src timeout 150 python3 megakernel_per_sm.py --precision fp8-block --tokens 8192 --experts 192 --stages 3,4 --rounds 4 --seconds 0.4 > $OUT/stages_fp8_8192_192.log 2>&1
tail -n 8 $OUT/stages_*.log
# ---- out/run_s46.sh (run 10)
#!/bin/bash
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd benchmarks
PYTHONPATH=../src timeout 150 python3 megakernel_per_sm.py --precision bf16 --tokens 8192 --experts 192 --stages 4,3 --rounds 6 --seconds 0.4 > $OUT/stages_bf16_8192_192_rep.log 2>&1
PYTHONPATH=../src timeout 150 python3 megakernel_per_sm.py --precision bf16 --tokens 8192 --stages 4,3 --rounds 6 --seconds 0.4 > $OUT/stages_bf16_8192_rep.log 2>&1
tail -n 8 $OUT/stages_*.log
