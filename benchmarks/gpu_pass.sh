#!/usr/bin/env bash
# One forward pass of the megakernel, looked at from outside the kernel, on nvidia-h200-x2 (EP 2, 8192 tokens/GPU).
# Usage (repo root): MEGAMOE_COMMIT=$(git rev-parse --short=12 HEAD) bash benchmarks/gpu_pass.sh PART OUTDIR
#   tests:     the GPU tests (every -m gpu test).
#   profile:   megakernel_profile.py (kernels of one pass on a timeline, eager and graphed) for qwen3.5-397b and
#              kimi-k2, bf16 and fp8-block.
#   host:      megakernel_host.py (host time of an eager pass, by stage and by function) for qwen3.5-397b, bf16
#              and fp8-block.
#   qwen-comm: comm_sms sweeps of qwen3.5-397b, bf16 and fp8-block, 8 to 16 (where its copies stop keeping up).
#   bench:     `megamoe bench` of the three presets, bf16 and fp8-block, eager and graphed, beside nccl-torch.
#   graph-sweep: comm_sms sweeps replayed from CUDA graphs (no host launch time), bf16 and fp8-block, of
#              PRESET (default qwen3.5-397b) at COMM_SMS (default 14,16,18,20).
#   experts-qwen: the expert GEMM tiles alone on qwen3.5-397b's load (81,920 rows over 256 experts, one GPU),
#              every candidate tile.
#   ep1:       `megamoe bench` of kimi-k2 on one GPU (EP 1), bf16 and fp8-block, eager and graphed.
set -u
part=${1:?tests, profile, host, qwen-comm, bench, graph-sweep, experts-qwen or ep1}
out=${2:?output folder}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
case "$part" in
tests)
  timeout 300 python3 -m pytest -q -m gpu tests/ 2>&1 | tail -15 > "$out/tests.txt"; tail -3 "$out/tests.txt" ;;
profile)
  for preset in qwen3.5-397b kimi-k2; do
    for precision in bf16 fp8-block; do
      timeout 150 python3 benchmarks/megakernel_profile.py --preset $preset --precision $precision \
          --out "$out/profile-$preset-$precision" > /dev/null 2>&1 || echo "profile $preset $precision failed"
      grep -E "rank|pass span" "$out/profile-$preset-$precision/profile.txt"
    done
  done ;;
host)
  for precision in bf16 fp8-block; do
    timeout 150 python3 benchmarks/megakernel_host.py --preset qwen3.5-397b --precision $precision \
        > "$out/host-qwen-$precision.txt" 2>&1 || echo "host $precision failed"
    tail -8 "$out/host-qwen-$precision.txt"
  done ;;
qwen-comm)
  for precision in bf16 fp8-block; do
    mkdir -p "$out/qwen-$precision"
    timeout 200 python3 benchmarks/megakernel_sweep.py --impl megamoe --preset qwen3.5-397b --tokens 8192 --iters 10 \
        --warmup 2 --precision $precision --minibatch= --comm-sms=8,10,12,14,16 --out "$out/qwen-$precision" \
        > "$out/qwen-$precision/sweep.log" 2>&1
    tail -7 "$out/qwen-$precision/sweep.log"
  done ;;
bench)
  for preset in kimi-k2 deepseek-v4-pro qwen3.5-397b; do
    timeout 270 python3 -m megamoe bench --preset $preset --tokens 8192 --ep 2 --impl nccl-torch,megamoe,megamoe-graph \
        --experts bf16,fp8-block --passes fwd --iters 10 --json "$out/$preset.json" --md "$out/$preset.md" 2>&1 | tail -8
  done ;;
graph-sweep)
  preset=${PRESET:-qwen3.5-397b}
  for precision in bf16 fp8-block; do
    mkdir -p "$out/$preset-graph-$precision"
    timeout 240 python3 benchmarks/megakernel_sweep.py --impl megamoe --graph --preset $preset --tokens 8192 \
        --iters 20 --warmup 2 --precision $precision --minibatch= --comm-sms=${COMM_SMS:-14,16,18,20} \
        --out "$out/$preset-graph-$precision" > "$out/$preset-graph-$precision/sweep.log" 2>&1
    tail -8 "$out/$preset-graph-$precision/sweep.log"
  done ;;
experts-qwen)
  timeout 300 python3 -m megamoe bench-experts --preset qwen3.5-397b --tokens 8192 --experts 256 --passes fwd \
      --sweep --json "$out/experts-qwen.json" > "$out/experts-qwen.txt" 2>&1
  tail -25 "$out/experts-qwen.txt" ;;
ep1)
  CUDA_VISIBLE_DEVICES=0 timeout 300 python3 -m megamoe bench --preset kimi-k2 --tokens 8192 --ep 1 \
      --impl nccl-torch,megamoe,megamoe-graph --experts bf16,fp8-block --passes fwd --iters 10 \
      --json "$out/kimi-k2-ep1.json" --md "$out/kimi-k2-ep1.md" 2>&1 | tail -8 ;;
*) echo "unknown part $part"; exit 2 ;;
esac
