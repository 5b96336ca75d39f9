"""One expert-GEMM tile variant on one GPU, in its own process: checked against the planner's tiles, then timed.

Warp-specialised variants can deadlock; run each under `timeout` (benchmarks/ws_probe.sh) so a hang costs one
variant, not the run. Prints one JSON line.

    python3 benchmarks/ws_probe.py --kind down --experts 192 --warps 4 --stages 3 --ws
"""

import argparse
import json

import torch
import triton

from megamoe.bench.experts import make_load
from megamoe.experts import TileConfig, down, expert_backward, expert_forward, plan_tiles


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--kind", choices=("down", "dx", "wgrad"), required=True)
    p.add_argument("--experts", type=int, default=192)
    p.add_argument("--warps", type=int, default=8)
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--block-k", type=int, default=64)
    p.add_argument("--ws", action="store_true", help="warp-specialise the task loop")
    p.add_argument("--plan", action="store_true", help="the planner's tiles (other tile flags ignored)")
    a = p.parse_args()
    dev = torch.device("cuda")
    routes, d, i = 65536, 7168, 2048
    x, counts, offsets, wgu, wd = make_load(a.experts, routes, d, i, dev)
    cfg = plan_tiles(a.kind, dev) if a.plan else TileConfig(128, 256, a.block_k, a.warps, a.stages, 8,
                                                             warp_specialize=a.ws)
    if a.kind == "down":
        act = torch.randn(routes, i, device=dev).bfloat16()
        y_ref, y = torch.empty(routes, d, device=dev).bfloat16(), torch.full((routes, d), float("nan"), device=dev).bfloat16()
        down(act, counts, offsets, wd, y_ref)
        run = lambda: down(act, counts, offsets, wd, y, tiles=cfg)  # noqa: E731
        run()
        torch.cuda.synchronize()
        got, want = {"y": y}, {"y": y_ref}
        flops = 2 * routes * d * i
    else:
        h = expert_forward(x, counts, offsets, wgu, wd).h
        dy = torch.randn(routes, d, device=dev).bfloat16()
        w = torch.rand(routes, device=dev)
        ref = expert_backward(dy, w, x, h, counts, offsets, wgu, wd)
        want = {"d_x": ref.d_x, "d_w_gate_up": ref.d_w_gate_up, "d_w_down": ref.d_w_down}
        del ref
        run = lambda: expert_backward(dy, w, x, h, counts, offsets, wgu, wd, tiles={a.kind: cfg})  # noqa: E731
        g = run()
        torch.cuda.synchronize()
        got = {"d_x": g.d_x, "d_w_gate_up": g.d_w_gate_up, "d_w_down": g.d_w_down}
        del g
        flops = 12 * routes * d * i
    bitwise = all(torch.equal(got[k], want[k]) for k in want)
    err = max(float((got[k].float() - want[k].float()).abs().max()) for k in want)
    got.clear()
    ms = triton.testing.do_bench(run, warmup=20, rep=150, return_mode="median")
    print(json.dumps({"kind": a.kind, "load": f"{a.experts}x{routes // a.experts}", "tiles": cfg.__dict__,
                      "pass_ms": round(ms, 3), "tflops": round(flops / ms / 1e9, 1), "bitwise_vs_plan": bitwise,
                      "max_abs_diff_vs_plan": err}), flush=True)


if __name__ == "__main__":
    main()
