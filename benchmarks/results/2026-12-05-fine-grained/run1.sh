export PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,power.limit,clocks.sm --format=csv
python3 -m pytest -q -m gpu tests/test_experts.py -k "dact_ws_gives" -x 2>&1 | tail -5
B="python3 -m megamoe bench --ep 1 --impl nccl-torch,megamoe --iters 10"
$B --preset deepseek-v3 --tokens 8192 --passes step --json $OUT/ds8.json --md $OUT/ds8.md > $OUT/ds8.txt 2>&1
$B --preset deepseek-v3 --tokens 16384 --passes step --json $OUT/ds16.json --md $OUT/ds16.md > $OUT/ds16.txt 2>&1
$B --preset qwen3-30b-a3b --tokens 16384 --passes fwd,bwd,step --json $OUT/q16u.json --md $OUT/q16u.md > $OUT/q16u.txt 2>&1
$B --preset qwen3-30b-a3b --tokens 16384 --routing zipf --passes step --json $OUT/q16z.json --md $OUT/q16z.md > $OUT/q16z.txt 2>&1
for pt in sonic-7b:24576 sonic-d4096:32768 sonic-120b:32768; do p=${pt%%:*}; $B --preset $p --tokens ${pt##*:} --passes fwd,bwd --json $OUT/$p.json --md $OUT/$p.md > $OUT/$p.txt 2>&1; done
for f in $OUT/*.md; do echo "== $f"; grep -E "^\|" $f | head -12; done
