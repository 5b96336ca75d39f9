"""One expert backward on a preset's load, after a warm-up call: the program a kernel profiler wraps.

    ncu --clock-control none --kernel-name regex:wgrad --launch-skip 2 --launch-count 1 --set full \\
        python3 benchmarks/expert_backward_once.py --precision fp8-block

``tokens x k`` rows spread evenly over --experts experts (as fp8_backward_ab.py) through `expert_backward`
(bf16) or the FP8 backward in --precision with the planner's tiles. Each call launches every kernel once per
GEMM (the wgrad twice: down, then gate/up), so --launch-skip counts the warm-up call's launches.
"""

from __future__ import annotations

import argparse

import torch

from megamoe.bench.experts import backward_load
from megamoe.config import preset
from megamoe.ops.experts_bwd import expert_backward
from megamoe.ops.expert_weights import transposed_weights
from megamoe.ops.experts_fp8_bwd import expert_backward_fp8_block, expert_backward_mxfp8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="kimi-k2")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--experts", type=int, default=192)
    parser.add_argument("--precision", choices=("bf16", "fp8-block", "mxfp8"), default="fp8-block")
    parser.add_argument("--triton", action="store_true",
                        help="bf16, fp8-block: the Triton kernels where Hopper runs Gluon ones (warp_specialized=False)")
    a = parser.parse_args()
    cfg, dev = preset(a.preset), torch.device("cuda")
    load = backward_load(cfg, a.experts, a.tokens, dev)
    args = load.args
    kw = {"warp_specialized": False} if a.triton and a.precision != "mxfp8" else {}
    if a.precision == "bf16":
        call = lambda: expert_backward(*args, **kw)  # noqa: E731
    else:
        wt = transposed_weights(load.w_gate_up, load.w_down, a.precision)
        fn = expert_backward_fp8_block if a.precision == "fp8-block" else expert_backward_mxfp8
        call = lambda: fn(*args, weights_t=wt, **kw)  # noqa: E731
    for _ in range(2):
        call()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
