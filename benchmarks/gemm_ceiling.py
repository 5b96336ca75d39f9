"""The BF16 GEMM ceiling of one GPU under its power cap: cuBLAS 8192^3 back to back, rate against time.

    PYTHONPATH=src python3 benchmarks/gemm_ceiling.py [--seconds 6] [--out OUT]
    python3 benchmarks/gemm_ceiling.py --from OUT   # a recorded run's summary again (no GPU)

After 3 s idle, `torch.mm` of two bf16 [8192, 8192] matrices runs back to back for --seconds in groups of 5
(CUDA events per group; `nvidia-smi` samples the SM clock and power every 50 ms beside it). Prints the rate
over the first 150 ms (what a timed burst of ~10 layer passes sees), over the last half (the steady state a
training step sees) and the clock and power of each; writes OUT/gemm_ceiling.json with every group and
OUT/gemm_ceiling_smi.csv with the samples.
The question: how fast can any BF16 layer be at this power cap, whatever it overlaps?
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time

import torch

N = 8192
GROUP = 5


def sample_smi(log) -> subprocess.Popen:
    """nvidia-smi writing the SM clock and power every 50 ms into the open file ``log``."""
    return subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw", "--format=csv,noheader,nounits",
                             "-i", os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0], "-lms", "50"],
                            stdout=log, stderr=subprocess.DEVNULL)


def summarize(ms: list[float], smi_lines: list[str]) -> dict:
    """The rates of a run: ``ms`` per group of GROUP GEMMs in order, ``smi_lines`` the sampler's CSV lines
    (timestamp, SM clock MHz, power W; 3 s idle first)."""
    flop = 2 * N**3 * GROUP
    t_gpu, rows = 0.0, []
    for m in ms:
        rows.append(dict(t_ms=t_gpu, ms=m, tflops=flop / m / 1e9))
        t_gpu += m

    def window(lo_ms, hi_ms):
        sel = [r for r in rows if lo_ms <= r["t_ms"] < hi_ms]
        total = sum(r["ms"] for r in sel)
        return dict(from_ms=lo_ms, to_ms=hi_ms, tflops=flop * len(sel) / total / 1e9 if total else 0.0)

    smi_rows = []
    for line in smi_lines:
        parts = [p.strip() for p in line.split(",")]
        try:
            smi_rows.append(dict(clock_mhz=float(parts[1]), power_w=float(parts[2])))
        except (ValueError, IndexError):
            pass
    # the sampler ran 3 s idle first; the busy samples are the last ones over the run's length
    busy = smi_rows[int(3.0 / 0.05):] if len(smi_rows) > 60 else smi_rows
    half = busy[len(busy) // 2:]
    mean = lambda xs, k: sum(x[k] for x in xs) / len(xs) if xs else 0.0  # noqa: E731
    return dict(burst_first_150ms=window(0, 150), steady_last_half=window(t_gpu / 2, t_gpu + 1),
                steady_clock_mhz=mean(half, "clock_mhz"), steady_power_w=mean(half, "power_w"),
                first_samples=busy[:4], groups=rows)


def print_summary(result: dict) -> None:
    burst, steady = result["burst_first_150ms"], result["steady_last_half"]
    print(f"cuBLAS bf16 {N}^3 on {result['device']}: first 150 ms {burst['tflops']:.0f} TFLOP/s; "
          f"last half ({steady['from_ms'] / 1e3:.1f}-{(steady['to_ms'] - 1) / 1e3:.1f} s) {steady['tflops']:.0f} "
          f"TFLOP/s at {result['steady_clock_mhz']:.0f} MHz, {result['steady_power_w']:.0f} W")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--out", default=os.environ.get("OUT", ""))
    parser.add_argument("--from", dest="from_", default="", help="a recorded run's folder (gemm_ceiling.json, "
                                                                 "gemm_ceiling_smi.csv): its summary again, no GPU")
    args = parser.parse_args()
    if args.from_:
        with open(os.path.join(args.from_, "gemm_ceiling.json")) as f:
            result = json.load(f)
        with open(os.path.join(args.from_, "gemm_ceiling_smi.csv")) as f:
            result.update(summarize([g["ms"] for g in result["groups"]], f.read().splitlines()))
        print_summary(result)
        return
    torch.manual_seed(0)
    a = torch.randn(N, N, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(N, N, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(N, N, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        torch.mm(a, b, out=c)
    torch.cuda.synchronize()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    smi_path = os.path.join(args.out or "/tmp", "gemm_ceiling_smi.csv")
    smi_log = open(smi_path, "w")
    smi = sample_smi(smi_log)
    time.sleep(3.0)  # idle: start cold, as a timed burst does
    groups = []
    start = time.time()
    while time.time() - start < args.seconds:
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(GROUP):
            torch.mm(a, b, out=c)
        e1.record()
        groups.append((e0, e1, time.time() - start))
        if len(groups) % 20 == 0:
            torch.cuda.synchronize()  # keep the host within ~1 s of the GPU so the wall clock means something
    torch.cuda.synchronize()
    time.sleep(0.2)
    smi.terminate()
    smi.wait()
    smi_log.close()
    with open(smi_path) as f:
        summary = summarize([g[0].elapsed_time(g[1]) for g in groups], f.read().splitlines())
    result = dict(
        device=torch.cuda.get_device_name(), torch=torch.__version__, commit=os.environ.get("MEGAMOE_COMMIT", "?"),
        command="PYTHONPATH=src python3 benchmarks/gemm_ceiling.py " + f"--seconds {args.seconds}",
        **summary,
    )
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gemm_ceiling.json"), "w") as f:
            json.dump(result, f, indent=1)
    print_summary(result)


if __name__ == "__main__":
    main()
