"""Started by torchrun in tests/test_cli.py: every rank reads its peer's symmetric buffer."""

import torch
import torch.distributed as dist

from megamoe.parallel.symmetric import BufferSpec, workspace
from megamoe.parallel.world import init_world

world = init_world("cpu")
ws = workspace(world, [BufferSpec("v", (1,), torch.int64)])
ws.local("v").fill_(100 + world.rank)
world.barrier()
print(f"rank {world.rank} of {world.size} read {int(ws.peer('v', (world.rank + 1) % world.size))}", flush=True)
world.barrier()
ws.free()
dist.destroy_process_group()
