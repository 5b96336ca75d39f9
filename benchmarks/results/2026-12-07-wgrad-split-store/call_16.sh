# call 16: deepseek-v3 at 8192 tokens pads its 256-row experts (257 +- 16 under uniform routing) to 128-row tiles by 1.256x (row_tiles.txt); the "few rows" tiles (64-row gate/up, down and dx tiles, BK 64 wgrad blocks) pad 1.128x. FEW_ROWS_PER_EXPERT 192 (today) against 288 (deepseek-v3's load takes the few-row tiles), each in its own process: the backward per kernel and the layer's passes
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd .gpu; mkdir -p $OUT/r; L=$OUT/log.txt; t0=$(date +%s)
cap() { local l=$(( 300 - ($(date +%s)-t0) )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
say() { echo "== $1 rc=$2 t=$(( $(date +%s)-t0 ))" >> $L; }
nvidia-smi --query-gpu=name,power.limit,clocks.sm,memory.total --format=csv >> $L
few() { python3 -c "import sys, runpy, megamoe.planner.tiles as t; t.FEW_ROWS_PER_EXPERT = $1; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')" "${@:2}"; }
for f in 288 192; do
  mkdir -p $OUT/r/f$f
  timeout $(cap 60) few $f benchmarks/backward_kernels.py --impl megamoe --rounds 3 --steady 1 --pass bwd --preset deepseek-v3 --out $OUT/r/f$f > $OUT/r/bk_f$f.txt 2>&1; say bk_f$f $?; grep -E "between events|_kernel" $OUT/r/bk_f$f.txt | head -8 >> $L
done
for f in 288 192; do
  timeout $(cap 90) python3 -c "import megamoe.planner.tiles as t; t.FEW_ROWS_PER_EXPERT = $f; from megamoe.cli import app; app(['bench', '--ep', '1', '--impl', 'megamoe', '--passes', 'fwd,bwd,step', '--iters', '5', '--steady', '1', '--preset', 'deepseek-v3', '--tokens', '8192', '--json', '$OUT/r/bench_f$f.json', '--md', '$OUT/r/bench_f$f.md'], prog_name='megamoe', standalone_mode=False)" > $OUT/r/bench_f$f.txt 2>&1; say bench_f$f $?; grep -E "^\| megamoe" $OUT/r/bench_f$f.md >> $L 2>/dev/null || tail -3 $OUT/r/bench_f$f.txt >> $L
done
(cd $OUT && tar czf r.tgz r && rm -rf r)
grep -v "^\s*$" $L | tail -40
