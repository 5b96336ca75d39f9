export PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd .gpu
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/test_backward_ring.py -k "replayed" 2>&1 | grep -vE "^\s*$" | tail -25
