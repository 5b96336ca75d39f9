"""Summarise an ncu report's raw stall metrics and SASS stall samples (run on the GPU machine)."""
import csv, io, subprocess, sys, collections
NCU = "/usr/local/cuda/bin/ncu"
rep, title = sys.argv[1], sys.argv[2]
out = [f"== {title}"]
raw = subprocess.run([NCU, "-i", rep, "--page", "raw", "--csv"], capture_output=True, text=True).stdout
rows = [r for r in csv.reader(io.StringIO(raw)) if r]
hdr, vals = rows[0], rows[-1]
stalls = {}
for h, v in zip(hdr, vals):
    if h.startswith("smsp__average_warps_issue_stalled_") and h.endswith("_per_issue_active.ratio"):
        try:
            stalls[h[len("smsp__average_warps_issue_stalled_"):-len("_per_issue_active.ratio")]] = float(v.replace(",", ""))
        except ValueError:
            pass
out.append("stall cycles per issued instruction by reason: " + ", ".join(
    f"{k} {v:.2f}" for k, v in sorted(stalls.items(), key=lambda kv: -kv[1]) if v >= 0.05))
src = subprocess.run([NCU, "-i", rep, "--page", "source", "--csv", "--print-source", "sass"], capture_output=True,
                     text=True).stdout
rows = [r for r in csv.reader(io.StringIO(src)) if r]
start = next(i for i, r in enumerate(rows) if any("Warp Stall Sampling (All" in c for c in r))
hdr = rows[start]
col = lambda name: next(i for i, c in enumerate(hdr) if c.startswith(name))
i_src, i_all, i_exe = col("Source"), col("Warp Stall Sampling (All"), col("Instructions Executed")
ins = []
for n, r in enumerate(rows[start + 1:]):
    if len(r) <= max(i_src, i_all, i_exe):
        continue
    try:
        s = int(r[i_all].replace(",", "") or 0)
        e = int(r[i_exe].replace(",", "") or 0)
    except ValueError:
        continue
    ins.append((n, s, e, r[i_src].strip()))
total = sum(s for _, s, _, _ in ins)
out.append(f"SASS instructions {len(ins)}, stall samples {total}")
ops = collections.Counter()
for _, s, _, t in ins:
    words = [w for w in t.split() if not w.startswith("@")]
    ops[words[0].split(".")[0] if words else "?"] += s
out.append("by opcode: " + ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in ops.most_common(16)))
out.append("top instructions: index samples (share) executed text")
for n, s, e, t in sorted(ins, key=lambda x: -x[1])[:45]:
    out.append(f"  {n:6d} {s:8d} ({100 * s / total:4.1f} %) {e:11d}  {t[:90]}")
# contiguous regions with samples, in 200-instruction windows
win = collections.Counter()
for n, s, _, _ in ins:
    win[n // 200] += s
out.append("samples by 200-instruction window: " + ", ".join(f"{k * 200}: {100 * v / total:.1f}%" for k, v in
                                                             sorted(win.items()) if v / total >= 0.01))
print("\n".join(out))
