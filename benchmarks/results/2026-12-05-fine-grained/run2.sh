export PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
R=$OUT/r; mkdir -p $R
python3 benchmarks/backward_kernels.py --preset sonic-7b --tokens 24576 --impl nccl-torch,megamoe --pass step --out $R > $R/bk_sonic7b.txt 2>&1
python3 benchmarks/backward_kernels.py --preset sonic-d4096 --tokens 32768 --impl megamoe --pass step --out $R > $R/bk_sonicd4096.txt 2>&1
python3 -m megamoe bench-experts --preset sonic-7b --tokens 24576 --experts 128 --sweep --profile --json $R/be_sonic7b.json > $R/be_sonic7b.txt 2>&1
python3 -m megamoe bench-experts --preset sonic-d4096 --tokens 32768 --experts 128 --sweep --profile --json $R/be_sonicd4096.json > $R/be_sonicd4096.txt 2>&1
python3 -m megamoe bench-experts --preset qwen3-30b-a3b --tokens 8192 --experts 128 --sweep --profile --json $R/be_qwen.json > $R/be_qwen.txt 2>&1
rm -f $R/*.json.gz
tar czf $OUT/r.tgz -C $OUT r && rm -rf $R
tar xzf $OUT/r.tgz -O r/bk_sonic7b.txt | tail -60
