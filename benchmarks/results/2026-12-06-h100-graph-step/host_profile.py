"""Host time of one megamoe training step at EP 1: issue time vs GPU time, and cProfile's top functions.

The record of the run in before/host_issue.txt (tree 8fd891f, one H100), run from a copy of the tree with
benchmarks/ on the path: ``PYTHONPATH=src python3 host_profile.py OUT`` (a one-off probe, kept with its result).
"""
import cProfile, io, pstats, sys, time, statistics, torch
sys.path.insert(0, "benchmarks")
from megamoe.bench.problem import make_problem
from megamoe.bench.runners import RUNNERS
from megamoe.config import preset
from megamoe.parallel.world import launch
from backward_kernels import drop_grads

def body(world, name, tokens, impl, prof_steps):
    cfg = preset(name)
    p = make_problem(cfg, world.rank, world.size, tokens, dtype=torch.bfloat16, device=world.device, seed=0)
    r = RUNNERS[impl](world, p)
    for _ in range(5):
        r.step(); drop_grads(r)
    torch.cuda.synchronize()
    issue, total = [], []
    for _ in range(10):
        torch.cuda.synchronize()
        t0 = time.perf_counter(); r.step(); t1 = time.perf_counter(); torch.cuda.synchronize(); t2 = time.perf_counter()
        drop_grads(r)
        issue.append((t1 - t0) * 1e3); total.append((t2 - t0) * 1e3)
    text = ""
    if prof_steps:
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(prof_steps):
            r.step(); drop_grads(r)
        torch.cuda.synchronize()
        pr.disable()
        s = io.StringIO()
        st = pstats.Stats(pr, stream=s); st.sort_stats("tottime").print_stats(35)
        st.sort_stats("cumtime").print_stats(60)
        text = s.getvalue()
    return statistics.median(issue), statistics.median(total), text

if __name__ == "__main__":
    out = sys.argv[1]
    for name, tokens in (("qwen3-30b-a3b", 8192),):
        for impl in ("megamoe",):
            iss, tot, text = launch(body, 1, name, tokens, impl, 10 if (impl == "megamoe" and tokens == 8192) else 0, device="cuda")[0]
            print(f"| {name} | {tokens} | {impl} | host issue {iss:.2f} ms | step {tot:.2f} ms |", flush=True)
            if text:
                open(f"{out}/prof_{name}_{tokens}.txt", "w").write(text)
