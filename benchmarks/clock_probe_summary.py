"""Mean SM clock and power of each GPU in each phase of benchmarks/clock_probe.py.

    python3 benchmarks/clock_probe_summary.py phases.json smi.csv
(smi.csv: `nvidia-smi --query-gpu=timestamp,index,clocks.sm,power.draw --format=csv,noheader,nounits -lms 10`)
The first and last 0.2 s of a phase are left out (launch and drain).
"""

from __future__ import annotations

import argparse
import json
from datetime import datetime, timedelta

STAMP = "%Y/%m/%d %H:%M:%S.%f"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("phases", help="clock_probe.py's output: one JSON line per rank")
    parser.add_argument("smi", help="the nvidia-smi samples (CSV, no header, no units)")
    args = parser.parse_args()
    phases_file, smi_file = args.phases, args.smi
    samples = []
    for line in open(smi_file):
        fields = [f.strip() for f in line.split(",")]
        if len(fields) < 4 or not fields[1].isdigit():
            continue
        try:
            samples.append((datetime.strptime(fields[0], STAMP), int(fields[1]), float(fields[2]), float(fields[3])))
        except ValueError:
            continue
    edge = timedelta(seconds=0.2)
    print("| rank (GPU) | phase | ms per pass | samples | SM MHz (mean, min) | power W (mean) |")
    print("|---|---|---|---|---|---|")
    for line in open(phases_file):
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        for ph in r["phases"]:
            t0, t1 = datetime.strptime(ph["start"], STAMP) + edge, datetime.strptime(ph["end"], STAMP) - edge
            inside = [s for s in samples if s[1] == r["device"] and t0 <= s[0] <= t1]
            if not inside:
                print(f"| {r['rank']} ({r['device']}) | {ph['phase']} | {ph['ms_per_pass']:.2f} | 0 | - | - |")
                continue
            mhz = [s[2] for s in inside]
            watts = sum(s[3] for s in inside) / len(inside)
            print(f"| {r['rank']} ({r['device']}) | {ph['phase']} | {ph['ms_per_pass']:.2f} | {len(inside)} | "
                  f"{sum(mhz) / len(mhz):.0f}, {min(mhz):.0f} | {watts:.0f} |")


if __name__ == "__main__":
    main()
