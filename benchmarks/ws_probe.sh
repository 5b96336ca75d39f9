#!/usr/bin/env bash
# Warp-specialised tile variants against the planner's, one process each under a timeout (a hang costs one line).
# Usage (repo root): MEGAMOE_COMMIT=<hash> bash benchmarks/ws_probe.sh OUTDIR
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONPATH=src PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=0
probe() { timeout 35 python3 benchmarks/ws_probe.py "$@" >> "$out/ws_probe.jsonl" 2>> "$out/ws_probe.err" \
          || echo "{\"args\": \"$*\", \"failed\": $?}" >> "$out/ws_probe.jsonl"; tail -1 "$out/ws_probe.jsonl"; }
for e in 192 16; do
  probe --kind down --experts $e --plan
  probe --kind down --experts $e --warps 4 --stages 3 --ws
  probe --kind down --experts $e --warps 4 --stages 4 --ws
done
for e in 192 16; do
  probe --kind dx --experts $e --plan
  probe --kind dx --experts $e --warps 4 --stages 3 --ws
  probe --kind wgrad --experts $e --warps 4 --stages 3 --ws
  probe --kind wgrad --experts $e --warps 4 --stages 5 --block-k 32 --ws
done
