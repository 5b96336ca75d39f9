"""benchmarks/backward_kernels.py with the BF16 dx and dact tiles' GROUP_M set to $AB_GROUP_M (the planner's: 8).

Why: under zipf routing deepseek-v3's heavy experts hold up to 60 row tiles, and each group of GROUP_M of them reads
the expert's weights again (ncu on one H100: the routed dx moves ~20 GB at 71 % of DRAM peak under zipf against ~17 GB
uniform). Run: AB_GROUP_M=16 PYTHONPATH=src python3 ab_group_m.py <backward_kernels.py's arguments>."""
import dataclasses
import os
import runpy
import sys

import megamoe.planner.tuning as tuning

group_m = int(os.environ["AB_GROUP_M"])
planned = tuning.plan_tiles


def plan_tiles(kind, device, rows_per_expert=None, *, compiled=False):
    tile = planned(kind, device, rows_per_expert, compiled=compiled)
    return dataclasses.replace(tile, group_m=group_m) if kind in ("dx", "dact") else tile


tuning.plan_tiles = plan_tiles
sys.argv = ["benchmarks/backward_kernels.py", *sys.argv[1:]]
runpy.run_path("benchmarks/backward_kernels.py", run_name="__main__")
