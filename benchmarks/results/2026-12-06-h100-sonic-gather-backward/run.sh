# SonicMoE side by side at sonic-7b and qwen3-30b-a3b with GATHER_BACKWARD on (carry [".gpu", ".sonic/carry"])
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
S=/tmp/sonic_site; mkdir -p $S && python3 -c "import tarfile; tarfile.open('.sonic/carry/site.tar.xz').extractall('$S', filter='data')" || exit 1
cd .gpu; mkdir -p $OUT
export PYTHONPATH=$PWD/src:$S:$S/nvidia_cutlass_dsl/python_packages PYTHONUNBUFFERED=1 \
  CUTE_DSL_CACHE_DIR=/tmp/cute_dsl_cache QUACK_CACHE_DIR=/tmp/quack_cache QUACK_HOME=/tmp/quack_home \
  QUACK_COMPILE_WORKERS=12 TVM_FFI_CACHE_DIR=/tmp/tvm_ffi_cache
python3 -c "import sonicmoe, quack, cutlass" || exit 3
nvidia-smi --query-gpu=name,power.limit,clocks.sm --format=csv > $OUT/gpu.txt
timeout 400 python3 benchmarks/sonic_side_by_side.py --sonic-tune off --shapes sonic-7b,qwen3-30b-a3b --out $OUT/sbs.json > $OUT/sbs.txt 2>&1; echo "rc=$?" >> $OUT/sbs.txt
tail -30 $OUT/sbs.txt
