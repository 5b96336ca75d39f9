#!/usr/bin/env bash
# FP8 routed experts in the forward megakernel, kimi-k2 EP 2, 8192 tokens/GPU, on nvidia-h200-x2. Usage (repo root):
#   MEGAMOE_COMMIT=$(git rev-parse --short=12 HEAD) bash benchmarks/gpu_fp8_megakernel.sh bench|presets|ep1|qwen|grid OUTDIR
# bench: the megakernel's GPU tests; `megamoe bench` with bf16, fp8-block and mxfp8 experts (weights quantised
#        once) beside nccl-torch.
# presets: the same for deepseek-v4-pro and qwen3.5-397b (bf16 and fp8-block).
# ep1:   kimi-k2 at EP 1 on GPU 0 (bf16 and fp8-block beside nccl-torch), and comm_sms sweeps there.
# qwen:  qwen3.5-397b at EP 2: traces (bf16, fp8-block) and comm_sms sweeps (is its pass copy-bound?).
# grid:  (minibatch x comm_sms) grids of bf16 and fp8-block, and a trace of one pass of each (where the
#        compute workers wait); OUTDIR/sweeps.json holds every point.
# The comparison of FP8 rows quantised on arrival with rows quantised by their owners that made the second the
# only way: benchmarks/results/2026-11-30-fp8-experts (commits 390f669, fc40094).
set -u
part=${1:?bench, presets, ep1, qwen or grid}
out=${2:?output folder}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
if [ "$part" = bench ]; then
  nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv > "$out/log.txt" 2>&1
  timeout 240 python3 -m pytest -q -m gpu tests/test_megakernel.py 2>&1 | tail -15 | tee -a "$out/log.txt" | tail -2
  timeout 240 python3 -m megamoe bench --preset kimi-k2 --tokens 8192 --ep 2 --impl nccl-torch,megamoe,megamoe-graph \
      --experts bf16,fp8-block,mxfp8 --passes fwd --iters 10 --json "$out/bench.json" --md "$out/bench.md" 2>&1 | tail -14
  exit 0
fi
if [ "$part" = presets ]; then
  for preset in deepseek-v4-pro qwen3.5-397b; do
    timeout 270 python3 -m megamoe bench --preset $preset --tokens 8192 --ep 2 --impl nccl-torch,megamoe,megamoe-graph \
        --experts bf16,fp8-block --passes fwd --iters 10 --json "$out/$preset.json" --md "$out/$preset.md" 2>&1 | tail -9
  done
  exit 0
fi
sweep() {  # name, extra args: one sweep, its points kept in $out/sweeps/name.json
  local name=$1; shift
  mkdir -p "$out/run-$name" "$out/sweeps"
  timeout 150 python3 benchmarks/megakernel_sweep.py --impl megamoe --preset kimi-k2 --tokens 8192 --iters 10 \
      --warmup 2 --out "$out/run-$name" "$@" > "$out/run-$name/sweep.log" 2>&1  # a later --preset wins
  echo "== $name" >> "$out/summary.txt"; tail -4 "$out/run-$name/sweep.log" | tee -a "$out/summary.txt"
  mv "$out/run-$name/sweep.json" "$out/sweeps/$name.json" 2>/dev/null; rm -rf "$out/run-$name"
}
if [ "$part" = qwen ]; then
  q="--preset qwen3.5-397b"
  timeout 100 python3 benchmarks/megakernel_trace.py $q --out "$out/trace-qwen-bf16.json" 2>&1 | tail -2
  timeout 100 python3 benchmarks/megakernel_trace.py $q --precision fp8-block --out "$out/trace-qwen-fp8-block.json" 2>&1 | tail -2
  sweep qwen-bf16-comm $q --minibatch= --comm-sms=16,20,28,32
  sweep qwen-fp8-block-comm $q --precision fp8-block --minibatch= --comm-sms=16,20,28,32
elif [ "$part" = ep1 ]; then
  export CUDA_VISIBLE_DEVICES=0
  timeout 240 python3 -m megamoe bench --preset kimi-k2 --tokens 8192 --ep 1 --impl nccl-torch,megamoe,megamoe-graph \
      --experts bf16,fp8-block --passes fwd --iters 10 --json "$out/kimi-k2-ep1.json" --md "$out/kimi-k2-ep1.md" 2>&1 | tail -9
  sweep ep1-bf16-comm --ep 1 --minibatch= --comm-sms=4,6,8,10,12
  sweep ep1-fp8-block-comm --ep 1 --precision fp8-block --minibatch= --comm-sms=4,6,8,10,12
  timeout 100 python3 benchmarks/megakernel_trace.py --out "$out/trace-ep1-bf16.json" 2>&1 | tail -1
else
sweep bf16-grid --grid --minibatch=1920,3840,7680 --comm-sms=10,12,14,16
sweep fp8-block-grid --precision fp8-block --grid --minibatch=1920,3840,7680 --comm-sms=10,12,14,16
timeout 100 python3 benchmarks/megakernel_trace.py --out "$out/trace-bf16.json" 2>&1 | tail -2
timeout 100 python3 benchmarks/megakernel_trace.py --precision fp8-block --out "$out/trace-fp8-block.json" 2>&1 | tail -2
fi
python3 - "$out" <<'PY'
import glob, json, os, shutil, sys
out = sys.argv[1]
runs = {os.path.basename(p)[:-5]: json.load(open(p)) for p in sorted(glob.glob(f"{out}/sweeps/*.json"))}
json.dump(runs, open(f"{out}/sweeps.json", "w"), indent=1)
shutil.rmtree(f"{out}/sweeps")
PY
