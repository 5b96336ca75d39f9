S=/tmp/sonic_site; mkdir -p $S && python3 -c "import tarfile; tarfile.open('.sonic/carry/site.tar.xz').extractall('$S', filter='data')" || exit 1
export PYTHONPATH=$PWD/.gpu/src:$S:$S/nvidia_cutlass_dsl/python_packages PYTHONUNBUFFERED=1 \
  CUTE_DSL_CACHE_DIR=/tmp/cute_dsl_cache QUACK_CACHE_DIR=/tmp/quack_cache QUACK_HOME=/tmp/quack_home \
  QUACK_COMPILE_WORKERS=12 TVM_FFI_CACHE_DIR=/tmp/tvm_ffi_cache NCCL_NVLS_ENABLE=0 \
  TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -c "import sonicmoe, quack, cutlass" 2>&1 | tail -5 || exit 3
nvidia-smi --query-gpu=name,power.limit --format=csv
timeout 520 python3 .gpu/benchmarks/sonic_side_by_side.py --sonic-tune off --shapes sonic-7b,qwen3-30b-a3b --out $OUT/sbs_untuned.json > $OUT/sbs.txt 2>&1; echo rc=$?
tail -45 $OUT/sbs.txt
