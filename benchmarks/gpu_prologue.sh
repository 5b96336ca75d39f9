# The pass prologue after 206d02f (schedule own_rows, atomic counts, fused FP8 staging copy): schedule kernels
# across knobs, qwen3.5-397b pass timelines, GPU tests. nvidia-h200-x2.
set -x
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src MEGAMOE_COMMIT=${MEGAMOE_COMMIT:?set it to the commit}
nvidia-smi --query-gpu=name,temperature.gpu,power.draw,clocks.sm --format=csv
timeout 120 python3 benchmarks/schedule_bench.py --out $OUT/schedule_bench.json > $OUT/schedule_bench.txt 2>&1; tail -30 $OUT/schedule_bench.txt
for p in bf16 fp8-block; do timeout 150 python3 benchmarks/megakernel_profile.py --preset qwen3.5-397b --tokens 8192 --precision $p --out $OUT/profile-qwen-$p > $OUT/profile-qwen-$p.log 2>&1; grep -B2 -A26 "graph: pass span" $OUT/profile-qwen-$p/profile.txt | head -30; done
timeout 300 python3 -m pytest -q -m gpu tests/test_megakernel.py tests/test_schedule.py > $OUT/pytest-gpu.log 2>&1; tail -3 $OUT/pytest-gpu.log
timeout 120 python3 -m pytest -q tests/test_formats.py -k "copies_x or into_out or matches_torch" > $OUT/pytest-formats-cuda.log 2>&1; tail -3 $OUT/pytest-formats-cuda.log
