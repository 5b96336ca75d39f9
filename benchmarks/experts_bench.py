"""Kept for the recorded commands: the expert GEMM bench now lives in `megamoe bench-experts`."""

import sys

from megamoe.cli import main

if __name__ == "__main__":
    args = sys.argv[1:]
    if "--out" in args:  # the old flag name
        args[args.index("--out")] = "--json"
    sys.argv = [sys.argv[0], "bench-experts", *args]
    main()
